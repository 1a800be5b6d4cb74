"""The cost model: device specs, compute and communication time, memory and liveness, symbolic formulas, calibration."""
