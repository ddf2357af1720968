"""peakprobe: find the softmax that bottlenecks training.

Per-head peakedness and logit-magnitude statistics across a model family's checkpoints, the
t^(1/3) growth-law fits, and a per-head bottleneck report.
"""

__version__ = "0.1.0"
