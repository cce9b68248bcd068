"""The sensor-stream daemon (`zeroedge daemon --config FILE`): torch-free on its run path
(onnxruntime, numpy, paho-mqtt, prometheus-client). See config.py for the TOML schema."""
