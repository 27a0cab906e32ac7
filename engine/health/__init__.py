"""Why a run goes wrong: per-layer health, the gradient noise scale from the lanes, where a NaN began."""
