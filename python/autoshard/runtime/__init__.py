"""What a parallelized model runs during training: the checks at each forward, gradient sums and averages, clipping, non-finite agreement, loss parallelism, the shard guard."""
