"""What the devices are doing: the telemetry sampler, NVML, the device list, and the environment a run ran in."""

from multilane.engine.exports import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "TelemetrySampler": "sampler",
        "parse_devices": "devices",
        "describe_devices": "devices",
        "environment": "envinfo",
    },
)
