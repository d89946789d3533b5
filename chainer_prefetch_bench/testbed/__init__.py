"""What the experiments share: storage emulator, datasets, processes, reports.

``storage/``          the emulated shared storage (FUSE), by concern
``jpeg_dataset``      the ImageNet-like JPEG dataset generator
``parquet_dataset``   the shopping-like Parquet dataset generator
``processes``         one measurement per fresh child process; SIGTERM
``prepare``           the common start of the JPEG benchmarks
``mpi_launch``        starting the ImageNet example under ``mpiexec``
``page_cache``        dropping files from the page cache
``machine``           what the numbers were measured on
``report``            JSON and figure writing
"""
