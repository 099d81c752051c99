"""Offline training of draft heads (not on the serving path).

An EAGLE-1/2 draft head for a target model, by self-distillation (EAGLE-1 recipe), one module
per stage, imports one way (prompts, data, head <- loss <- eval <- loop <- cli):

1. `prompts`: prompts from templates (tasks x topics, chat-templated, plus some raw-text
   continuations), tokenised on the CPU: `eaglekv train-draft prompts --out prompts.json`.
2. `data`: `eaglekv train-draft train --prompts prompts.json --out DIR ...` (on a GPU): the
   target (Hugging Face transformers, built from eaglekv's loader so the weights are the ones
   the engine serves) writes the responses (`generate`, batched, left padding, sampled at
   temperature 0.7 / top-p 0.95 and some greedy), then one forward per batch gives the feature
   f_p of every position = the target's last hidden state after the final norm (what its LM
   head reads).
3. `head` + `loss` + `loop`: the head (`EagleHead`, a plain nn.Module in the published key
   layout) learns, for every position p, (tok_{p+1}, f_p) -> g_p with g_p ~ f_{p+1}:
       loss = SmoothL1(g_p, f_{p+1}) + 0.1 * CE(softmax(head(f_{p+1})), head(g_p))
   with uniform noise on the input features, causal attention over the head's own positions
   and RoPE at the token positions, exactly as the engine runs it (draft input at position p is
   (token p+1, feature p)).
4. `eval`: top-1 accuracy = argmax head(g_p) == argmax head(f_{p+1}) (what a greedy verify
   accepts); a 3-step greedy chain on held-out greedy responses estimates the accept length of
   `--num-steps 3 --topk 1`.
5. `cli`: the stages in order; the head is saved with `save_eagle_draft` (bf16, safetensors, no
   embed_tokens: the engine uses the target's embedding and LM head).
   `python -m eaglekv.training.train_draft` runs the same command line as `eaglekv train-draft`.
6. `eval_draft`: `eaglekv eval-draft` measures a head with the real engine on held-out prompts
   (fixed shapes x temperatures against plain decoding: accept length, rate per draft position,
   histogram, tokens/s, greedy outputs checked token for token).
"""
