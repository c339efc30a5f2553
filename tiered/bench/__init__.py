"""The bandwidth harness behind `tiered bench` and benchmarks/bandwidth.py.

`methods` holds the ways one buffer is moved to a file and back (tiered's backends through
`tiered.open_backend`, a threaded O_DIRECT ceiling, fio and DeepSpeed's aio as subprocess / op
peers); `runner` times them round-robin and reports GB/s and ratios to the ceiling; `sweep` does
so per transfer size. `pattern` derives one model + config's storage I/O per step from the
engine's planning, `training` replays it through the engine's tier manager, `training_check`
runs real steps beside it, `tune` sweeps the nvme knobs on it. `preflight` refuses what cannot
fit before anything is written, `gpu_link` times the GPU<->CPU copies, `progress` is the bar or
the plain lines. Most import torch; import the module you need directly.
"""
