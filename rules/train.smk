# stage: train (rules land here)
