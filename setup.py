"""Build zeroshard. The C++/CUDA flatten extension is optional (see zeroshard/ext.py)."""
from setuptools import find_packages, setup

setup(
    name="zeroshard",
    version="0.1.0",
    description="A from-scratch ZeRO-3 sharding engine for PyTorch with torch FSDP1 semantics",
    packages=find_packages(include=["zeroshard", "zeroshard.*"]),
    python_requires=">=3.10",
    install_requires=["torch==2.13.0"],
)
