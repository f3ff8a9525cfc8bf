#!/usr/bin/env bash
# Wheels the GPU machine lacks, for its Python 3.12 and torch 2.11 (it reaches no package
# registry): torchao for float8 training, and TorchTitan 0.2.2 (the last TOML release, the last
# one that runs on torch 2.11) with the dependencies its image does not hold. Run here, in the
# repository root; the wheels land in .whl/ (in .gitignore: the device tool's `carry` takes it), about 6 MB. See docs/gpu_session.md.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for spec in torchao==0.18.0 torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 \
            typeguard==4.6.1 datasets==4.7.0 "dill==0.4.0" "multiprocess==0.70.18" tomli==2.3.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls -la .whl
