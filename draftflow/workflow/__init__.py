"""Glue between Snakemake and the package: script set-up, GPU leases, code digests."""
