"""The torch_npu kernels' binding and what the compile asks of the device about them: the kernels
(`kernels.py`), the torch_npu functions each needs (`api.py`), the kernels' documented and source rules
(`rules.py`), windows and sinks (`features.py`), MLA (`mla.py`), the workspace queries (`workspace_queries.py`)
and the device probes (`form_probe.py`, `band_probe.py`)."""
