#!/usr/bin/env python3
"""Build a TensorRT-LLM engine (FP8 weights, FP16 KV cache) from a local Orpheus checkpoint.

    python build_engine.py --config config/model_config.yaml [--model models/orpheus]
                           [--out engines/NAME] [--dtype fp8|fp16|bf16]

Needs TensorRT-LLM 1.2.x and a CUDA GPU (see docs/TENSORRT.md); `--help` works anywhere.
The work is in `orpheus_serve.engines.trtllm_build`.
"""

import sys

from orpheus_serve.engines.trtllm_build import main

if __name__ == "__main__":
    sys.exit(main())
