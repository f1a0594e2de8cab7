"""Engine configuration: every option defined once, in typed groups (pagoda/config/engine.py),
and read from the command line, ``PAGODA_*`` variables and ``--config`` files
(pagoda/config/options.py). Standard library only, below everything that runs the model."""

from pagoda.config.engine import (
    GROUPS,
    PIPELINE_MODES,
    QUANTIZATION_MODES,
    SCHEDULING_POLICIES,
    CacheOptions,
    DeviceOptions,
    DisaggregationOptions,
    EngineConfig,
    LoadOptions,
    LoRAOptions,
    ModelOptions,
    ParallelOptions,
    SchedulerOptions,
    SpeculativeOptions,
)

__all__ = ["GROUPS", "PIPELINE_MODES", "QUANTIZATION_MODES", "SCHEDULING_POLICIES", "CacheOptions", "DeviceOptions",
           "DisaggregationOptions", "EngineConfig", "LoRAOptions", "LoadOptions", "ModelOptions", "ParallelOptions",
           "SchedulerOptions", "SpeculativeOptions"]
