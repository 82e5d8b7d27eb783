"""Token samples: chat-template loss masks (masks), tokenize, split and shard stages.

``samples`` holds the Parquet schema all three stages (and extract) share.
"""
