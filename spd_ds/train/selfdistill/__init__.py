"""Self-distilled training data at scale: the target answers every user turn of every conversation, in rounds.

EAGLE's advice, taken to the whole conversation: the head is used on the target's own text, so it is distilled on
the target's answers, including later turns whose context holds the target's *own* earlier answers.

**Rounds.** Round ``r`` answers user turn ``r`` of every conversation that has one. Its prompt is the token-level
continuation of round ``r-1``: ``prompt_r = prompt_{r-1} + answer_{r-1} (ending with the end-of-turn token the
target generated) + glue_r``, where ``glue_r`` is what the chat template renders between the end of that answer and
the generation prompt of turn ``r`` (for ChatML: ``"\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``).
Each *variant* of a conversation is its own chain: variant 0 is greedy (``greedy=1``), variants ``greedy..greedy +
samples - 1`` are samples at ``temperature``; a sampled chain's turn 2 sees that chain's turn-1 answer. A chain ends
at an answer cut by ``max_new_tokens`` (no end-of-turn: no later turn is asked), at a prompt longer than
``max_prompt_tokens``, or at a template that rewrites earlier turns (the prefix property fails).

**Generation** is transformers' own ``generate`` (left padding, prompts sorted by length, ``cache_implementation=
"static"`` so that on CUDA the decode step is compiled and CUDA-graphed by transformers, ``CompileConfig(dynamic=
True)``), with three small additions passed through its public hooks:

* :class:`StopWhenFewAlive` (a ``StoppingCriteria``) ends a call after ``chunk_new_tokens`` new tokens or once fewer
  than ``min_alive`` of its rows are still generating; the unfinished rows are *continued* in a later call (prompt +
  answer so far as the new prompt, prefilled again). A static batch otherwise decodes for its longest answer while
  most rows idle, and a static cache sized for the longest answer makes every step attend over it;
* :func:`gqa_decode_attention` (registered through ``AttentionInterface``, transformers' hook for custom attention)
  is SDPA that, for one query token, folds the query heads of each key/value head into the query length instead of
  copying keys and values per query head (``repeat_kv``): with left padding SDPA gets a mask, and transformers
  then materialises the repeated cache on every decode step (3x the cache for SmolLM2, the largest cost of a step);
* :class:`KeyedSampler` (a ``LogitsProcessor``) makes sampling a pure function of ``(seed, conversation, variant,
  round, answer position)``: one 32-bit uniform per row from an integer hash, inverted through the row's CDF
  (float64), the chosen token then taken by ``generate``'s greedy argmax. So greedy and sampled rows share a batch,
  a continuation draws exactly what an uninterrupted run would, and a resumed run redraws the same answers whatever
  the batch composition (up to floating-point differences between batch shapes). No top-k / top-p: the target's full
  distribution at ``temperature``.

**Storage** (:func:`write_shard`): ``np.savez_compressed`` shards ``shard-r<round>-<seq>.npz``, each at most
``shard_bytes`` (12 MB by default, uncompressed) so any shard can travel on its own, plus ``manifest.json``. A shard
holds finished answers ("items"), each as one *segment*: the tokens the item adds to its chain (round 1: the prompt;
later rounds: the glue) followed by the answer. Arrays (``N`` items, ``T`` tokens)::

    ids         [T]    uint16 (vocabulary <= 65535) or int32   token ids, segments back to back
    offsets     [N+1]  int64    segment i is ids[offsets[i]:offsets[i+1]]
    prompt_len  [N]    int32    tokens of segment i before its answer (assistant mask = 0), the rest is the answer
    uid         [N]    str      conversation id (the source's ``id``, else a hash of its first prompt)
    variant     [N]    int16    0 = greedy when greedy=1, else a sample
    round       [N]    int16    1 = first user turn
    finish      [N]    int8     0 = ended with an EOS id (kept, under the mask), 1 = cut at max_new_tokens

A training record (:func:`iter_records`) is a chain: the segments of rounds 1..k of one ``(uid, variant)``
concatenated, ``assistant_mask`` 1 on every answer token (the answer text and the end-of-turn token the target
generated, as :mod:`spd_ds.train.chat` marks conversations). ``data.train_files`` accepts the output directory.

**Resume**: items already in a shard are skipped, so a rerun with the same ``--out`` continues; a time budget stops
starting new ``generate`` calls, and finished answers are flushed to a shard at least every ``flush_every_s`` and on
exit (including SIGTERM from ``timeout``); in the last 10 % of the budget only answers already begun are continued;
answers still in flight at the end are redone by the next run.

**Held-out split**: :func:`spd_ds.train.split.split_held_out` (by a hash of the conversation id; see there).

Modules: :mod:`.config` (settings, errors, format constants), :mod:`.prompts` (rounds, chat glue),
:mod:`.generation` (keyed sampling, stopping, gqa-decode attention, :class:`AnswerGenerator`), :mod:`.storage` (npz
shards, records, the output directory), :mod:`.run` (:func:`run_selfdistill`). Their names are re-exported here.
"""

from spd_ds.train.selfdistill.config import (
    FINISH_EOS, FINISH_LENGTH, FORMAT, MANIFEST, SHARD_PREFIX, SelfDistillConfig, SelfDistillError,
)
from spd_ds.train.selfdistill.generation import (
    GQA_DECODE, AnswerGenerator, CallStats, KeyedSampler, Row, StopWhenFewAlive, gqa_decode_attention, item_key,
    keyed_uniform, register_gqa_decode_attention,
)
from spd_ds.train.selfdistill.prompts import (
    PromptConversation, conversation_rounds, load_prompt_conversations, turn_glue, write_prompts,
)
from spd_ds.train.selfdistill.run import run_selfdistill, throughput_table
from spd_ds.train.selfdistill.storage import (
    Item, chain_record, chains, id_dtype_for, is_selfdistill_path, iter_records, model_fingerprint, read_items,
    read_manifest, read_shard, shard_files, shard_stats, write_shard,
)

__all__ = [
    "FINISH_EOS", "FINISH_LENGTH", "FORMAT", "MANIFEST", "SHARD_PREFIX", "SelfDistillConfig", "SelfDistillError",
    "GQA_DECODE", "AnswerGenerator", "CallStats", "KeyedSampler", "Row", "StopWhenFewAlive", "gqa_decode_attention",
    "item_key", "keyed_uniform", "register_gqa_decode_attention", "PromptConversation", "conversation_rounds",
    "load_prompt_conversations", "turn_glue", "write_prompts", "run_selfdistill", "throughput_table", "Item",
    "chain_record", "chains", "id_dtype_for", "is_selfdistill_path", "iter_records", "model_fingerprint", "read_items",
    "read_manifest", "read_shard", "shard_files", "shard_stats", "write_shard",
]
