#!/bin/sh
# The PyTorch wheel index for an image variant: `torch-index.sh cpu|cuda [CUDA_TAG]`.
# The CUDA wheels bring their own CUDA runtime; the node only needs the NVIDIA driver.
set -eu
variant=${1:-}
cuda=${2:-cu128}
case "$variant" in
  cpu) echo "https://download.pytorch.org/whl/cpu" ;;
  cuda) echo "https://download.pytorch.org/whl/$cuda" ;;
  *) echo "torch-index.sh: VARIANT must be cpu or cuda, got '$variant'" >&2; exit 2 ;;
esac
