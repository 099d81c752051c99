"""`python -m eaglekv.training.train_draft {prompts,train} ...` (= `eaglekv train-draft ...`).

The trainer lives in stages (see eaglekv/training/__init__.py); this module keeps the names it
had before the split importable from here and runs the command line.
"""

from __future__ import annotations

import sys

from eaglekv.training.cli import (add_arguments, build_parser, cmd_prompts, cmd_train, main,
                                  run)
from eaglekv.training.data import (FeatureData, batches, extract_features, generate,
                                   load_seqs, load_target, save_seqs)
from eaglekv.training.eval import chain_accept, evaluate
from eaglekv.training.head import (MLP, Attention, EagleHead, Layer, RMSNorm, head_for_target,
                                   rotate_half)
from eaglekv.training.loop import train
from eaglekv.training.loss import step_loss, target_embed_head
from eaglekv.training.prompts import (ACTIONS, CODE, CODE_TASKS, HOWTO, RAW, TASKS, TOPICS,
                                      build_prompts, tokenize_prompts)

__all__ = ["ACTIONS", "CODE", "CODE_TASKS", "HOWTO", "RAW", "TASKS", "TOPICS", "build_prompts",
           "tokenize_prompts", "FeatureData", "batches", "extract_features", "generate",
           "load_seqs", "load_target", "save_seqs", "MLP", "Attention", "EagleHead", "Layer",
           "RMSNorm", "head_for_target", "rotate_half", "step_loss", "target_embed_head",
           "chain_accept", "evaluate", "train", "add_arguments", "build_parser", "cmd_prompts",
           "cmd_train", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
