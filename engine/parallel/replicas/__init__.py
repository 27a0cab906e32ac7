"""How every lane holds a true replica and the lanes stay one model: replication, buffers, in-place writes, each lane's random stream and context, BatchNorm across lanes."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "replicate_module": "replica",
        "LaneRandom": "lane_rng",
    },
)
