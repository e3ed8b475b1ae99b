#!/usr/bin/env python3
"""Write a small model that vLLM loads from a local directory (``testing.tiny_model``: Llama,
DeepSeek-V2 with MLA, Qwen3-Next; no downloads).

    python scripts/make_tiny_model.py models/tiny-llama --layers 2 --kv-heads 2 --head-size 64
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file, from anywhere

from testing.tiny_model import main

if __name__ == "__main__":
    sys.exit(main())
