"""Measurement: the engine that times steps, reads peak memory and searches the largest batch
(`engine`), FLOPs and MFU (`flops`), the precision doctor (`doctor`), and the one writer of every
measuring tool's report (`report`)."""
