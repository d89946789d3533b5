"""Datasets: Parquet files read row group by row group, and their order sampler."""
from chainer_prefetch._extras import require_extra

require_extra('parquet', 'chainer_prefetch.datasets', ['pyarrow'])

from chainer_prefetch.datasets.parquet_dataset import (  # noqa: E402
    ParquetDataset,
    find_parquet_files,
)
from chainer_prefetch.datasets.partitions import Partitions  # noqa: E402
from chainer_prefetch.datasets.row_group_order import (  # noqa: E402
    RowGroupWindowOrderSampler,
    row_groups_per_batch,
)
from chainer_prefetch.datasets.row_group_source import (  # noqa: E402
    DecodedRowGroup,
    RowGroupFile,
    read_row_group,
)
from chainer_prefetch.datasets.split import (  # noqa: E402
    assign_row_groups,
    scatter_row_groups,
)
from chainer_prefetch.errors import (  # noqa: E402
    ParquetColumnError,
    ParquetFileError,
    ParquetSchemaError,
)

__all__ = ['DecodedRowGroup', 'ParquetColumnError', 'ParquetDataset', 'ParquetFileError',
           'ParquetSchemaError', 'Partitions', 'RowGroupFile', 'RowGroupWindowOrderSampler',
           'assign_row_groups', 'find_parquet_files', 'read_row_group',
           'row_groups_per_batch', 'scatter_row_groups']
