"""Parameters and gradients as every part of the engine walks them: sparse, sharded (DTensor), absent (None) or shared (tied)."""
