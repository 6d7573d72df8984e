"""Data: loaders for local files (nothing is downloaded), the data-set types, batch sources, memory-mapped arrays and
text files."""
