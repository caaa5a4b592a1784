from setuptools import find_packages, setup

setup(
    name="atorch",
    version="0.1.0",
    description="Make PyTorch training fast on one or many devices: auto_accelerate with shareable strategies",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["atorch", "atorch.*"]),
    # the hardware profiles of `atorch plan --search` ship with the package
    package_data={"atorch.auto.search.profiles": ["*.json"]},
    install_requires=[
        # fully_shard (FSDP2), DeviceMesh and torch.distributed.pipelining as public APIs.
        "torch>=2.6",
        "pydantic>=2.5",
        "pyyaml>=6",
        # torch.distributed.pipelining hangs a rank without numpy.
        "numpy",
    ],
    entry_points={"console_scripts": ["atorch = atorch.cli.main:main"]},
    extras_require={
        "hf": ["transformers>=4.45"],
        # atorch.integrations: AtorchTrainer (a transformers.Trainer) and AtorchStrategy (Lightning).
        "transformers": ["transformers>=5.0"],
        "lightning": ["lightning>=2.4"],
        "deepspeed": ["deepspeed>=0.14"],
        "fairscale": ["fairscale>=0.4.13"],
        # atorch.checkpoint.export writes safetensors when it is installed.
        "safetensors": ["safetensors>=0.4"],
        # benchmarks/: plots and the Hugging Face Accelerate comparison.
        "bench": ["matplotlib>=3.7", "accelerate>=0.30"],
        "transformer-engine": ["transformer-engine[pytorch]>=1.8"],
        # module_replace's kernels="liger": fused Triton kernels for transformers' blocks (CUDA GPUs).
        "liger": ["liger-kernel>=0.5"],
        "peft": ["peft>=0.10"],
        # atorch.utils.steplog.TensorBoardWriter.
        "tensorboard": ["tensorboard>=2.14"],
        # The suite runs the optional back-ends too, so CI installs them.
        "dev": [
            "pytest>=8", "pytest-timeout>=2.3", "ruff",
            "transformers>=4.45", "peft>=0.10", "deepspeed>=0.14", "fairscale>=0.4.13",
            "safetensors>=0.4", "matplotlib>=3.7", "accelerate>=0.30", "tensorboard>=2.14", "lightning>=2.4",
        ],
    },
)
