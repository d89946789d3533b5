"""The 10-epoch data-parallel training comparison (the source paper, secs. 4.2-4.4)."""
