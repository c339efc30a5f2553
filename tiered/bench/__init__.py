"""The bandwidth harness behind `tiered bench` and benchmarks/bandwidth.py.

`methods` holds the ways one buffer is moved to a file and back (tiered's backends through
`tiered.open_backend`, a threaded O_DIRECT ceiling, fio and DeepSpeed's aio as subprocess / op
peers); `runner` times them round-robin and reports GB/s and ratios to the ceiling. Both import
torch; import the module you need directly.
"""
