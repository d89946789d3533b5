"""Datasets: Parquet files read row group by row group, and their order sampler."""
from chainer_prefetch.datasets.parquet import (  # NOQA
    ParquetColumnError, ParquetDataset, ParquetFileError, ParquetSchemaError,
    RowGroupFile, find_parquet_files, read_row_group)
from chainer_prefetch.datasets.row_group_order import (  # NOQA
    RowGroupWindowOrderSampler, row_groups_per_batch)
