"""The Health view: per-layer health as heatmaps of layers × steps, the gradient noise scale beside the batch."""
