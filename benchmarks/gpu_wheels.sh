#!/usr/bin/env bash
# The wheels a lent GPU machine needs before benchmarks/gpu_session.sh can import this project:
# the dependencies (pyproject.toml) its image lacks, for its Python 3.12 on x86-64, into .whl/
# (ignored by git; name it in the device call's carry). The image's packages are listed in the
# workplace's device notes (KINDS.md, read 2026-11-17): jax, flax, optax, chex, numpy, pyyaml,
# scikit-learn, orbax-checkpoint, tqdm, safetensors, absl-py, etils, protobuf are there; these
# are not (and on 2026-11-29 a lease without them stopped at `import pydantic`).
#
#   bash benchmarks/gpu_wheels.sh            (run here, with pip and the registry)
set -eu
cd "$(dirname "$0")/.."
# The image's Python packages that this project depends on (of its full list, as read there):
IMAGE_HAS=(jax flax optax chex numpy pyyaml scikit-learn orbax-checkpoint tqdm safetensors absl-py etils protobuf
           cloudpickle opt-einsum packaging pytest pytest-xdist hypothesis transformers tokenizers)
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 qwix==0.1.8
        tensorboardX==2.6.5 jmp==0.0.4)
PLATFORMS=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
           manylinux2014 manylinux1; do PLATFORMS+=(--platform "${tag}_x86_64"); done
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d .whl "${WHEELS[@]}"
ls .whl
echo "carry .whl in the device call; benchmarks/gpu_session.sh installs them first"
