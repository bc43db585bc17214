"""The input side: which files a run reads (resolved once), their Parquet footers and blocks, and
the tokens decoded and checked block by block."""
