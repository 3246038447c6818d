#!/usr/bin/env bash
# Continue the equal-tokens heads of docs/training.md ("SPD and PPSD at equal tokens") on one GPU, one after the
# other, each warm-started from its best head for another 3,600 steps (lr 5e-4, the same recipe otherwise), as a
# detached job that spans several device calls (scripts/gpu_detached.sh); results come back with
# scripts/gpu_collect.sh in every `wait` call.
#
#   bash scripts/gpu_continue_heads.sh start     # copies the tree to $REPO, writes $WORK/chain.sh, starts it
#   bash scripts/gpu_continue_heads.sh warm      # copies runs/warm*/<head>/ (carried) to $WORK/warm/
#   bash scripts/gpu_continue_heads.sh wait [S]  # waits up to S seconds (default 500), then fetches into $OUT
#   bash scripts/gpu_continue_heads.sh fetch     # what is new under $WORK, packed into $OUT (<= 8 files)
#
# The chain waits (up to 30 min) for each head's warm start to appear in $WORK/warm, so `warm` may come after `start`
# and later heads may be carried by later calls. CHAIN (at `start`) names the heads, in order. A head's name is its
# run's letter and its base: bases 2 3 4 6 (one-layer SPD towers, n = 2, 3, 4, 6), p3 p6 (one-layer PPSD, n = 3, 6),
# 2l2 3l2 (two-layer SPD, n = 2, 3); letters w x y z a b c d e f g h for the 2nd to 13th run, each warm-started from
# the run before (w2 <- s2, x2 <- w2, wp3 <- p3, xp3 <- wp3, e2l2 <- d2l2, ...); default "w2 w3 wp3 w4". Every
# continued head puts its best head into $WORK/warm too, so CHAIN="s2l2 w2l2 x2l2" is the whole 10,800 steps on a
# machine that holds no warm start.
# A warm start's own name in CHAIN (s2 s3 p3 s4 s6 p6 s2l2 s3l2) trains it first, fresh, with the equal-tokens recipe
# (lr 1e-3, 3,600 steps: docs/training.md "SPD and PPSD at equal tokens"), and puts its best head into $WORK/warm:
# CHAIN="s4 w4" = the whole 7,200 steps on a machine that holds no warm start (a run repeats exactly on one H200).
# Heads joined by + ("w2+w3 wp3+w4") train at the same time, one process each on the one GPU: the steps and
# the data are the same as alone, only the wall time differs. Measured (sixteenth session): w2+w3 took 537 s of
# steps together against 539 s one after the other, so a pair saves only the second start (~35 s of model load).
# Alone on one H200 a continuation takes about 310 s (n = 2), 400 s (n = 3), 450 s (n = 4), 600 s (n = 6).
# The runs of one base share one torch.compile cache (train.compile_cache): a head alone in its item starts from
# $WORK/compile_cache/train_<base>.bin.gz (an earlier run of the chain's) or the carried
# runs/compile_cache/train_<base>.bin[.gz], and leaves its own there, gzip'd, when it differs from the one it started
# from (an unchanged one is not sent again, nor a carried one sent back), which `wait` and `fetch` return (as
# compile_cache/train_<base>.bin.gz in collect_<N>.tgz: `tar xzf - -C runs compile_cache/` puts them in
# runs/compile_cache/; PPSD n = 3's is 37 MB, 4.5 MB gzip'd, SPD n = 6's 70 MB, 8.1 MB); carry that folder with
# `start` on the next fresh machine.
# Knobs: WORK (/root/spd_work), REPO (/root/spd_repo), STEPS (3600), LR (5.0e-4), SPD_TRAIN_DATA
# (runs/train_data/sharegpt.jsonl.gz, carried), DRY=1 (`start` prints the chain script instead of starting it).
# On the GPU machine, after `source .devkit/on_device.sh` (the kit: docs/training.md "SmolLM2 heads on a GPU").
set -uo pipefail
WORK=${WORK:-/root/spd_work}
REPO=${REPO:-/root/spd_repo}
HERE=$(cd "$(dirname "$0")/.." && pwd)
declare -A BASE_SHAPE=([2]="partition.num_stages=2" [3]="partition.num_stages=3" [4]="partition.num_stages=4"
                       [6]="partition.num_stages=6" [p3]="partition.num_stages=3,partition.anchors=[0,10]"
                       [p6]="partition.num_stages=6,partition.anchors=[0,5]" [2l2]="partition.num_stages=2"
                       [3l2]="partition.num_stages=3")
RUN_LETTERS="w x y z a b c d e f g h"  # the 2nd, 3rd, ... 13th run of a head: <letter><base> (w2, x2l2, ap3, ...)
declare -A SRC=() SHAPE=()  # a continuation's warm start (the run before it) and its shape
for base in "${!BASE_SHAPE[@]}"; do
  prev=$base; [[ $base == p* ]] || prev=s$base  # the fresh run: s2, s4l2 ...; PPSD's p3, p6
  for letter in $RUN_LETTERS; do
    SRC[$letter$base]=$prev; SHAPE[$letter$base]=${BASE_SHAPE[$base]}; prev=$letter$base
  done
done
declare -A FRESH=()  # the warm starts trained fresh: their continuation's shape (+ the two-layer tower of *l2)
for w in "${!SRC[@]}"; do
  [[ -n "${SRC[${SRC[$w]}]:-}" ]] && continue  # its warm start is itself a continuation, not trained fresh
  FRESH[${SRC[$w]}]=${SHAPE[$w]}; [[ $w == *l2 ]] && FRESH[${SRC[$w]}]+=",head.num_layers=2"
done
declare -A IS_SRC=()  # heads that are another head's warm start: their best head goes to $WORK/warm
for w in "${!SRC[@]}"; do IS_SRC[${SRC[$w]}]=1; done
RECIPE="head.lm_head_from_target=true head.tower_init_layer=-1 train.lr_stable_fraction=0.6 train.warmup_steps=50"

base_of() {  # a head's base: s2 w2 x2 -> 2, s2l2 e2l2 -> 2l2, p3 wp3 -> p3
  if [[ -n "${BASE_SHAPE[$1]:-}" ]]; then echo "$1"; else echo "${1:1}"; fi
}

chain_script() {  # the detached job: one gpu_train_session.sh per item (a head, or heads joined by +), own OUT each
  echo "cd $REPO"
  echo "[ -f .devkit/on_device.sh ] && source .devkit/on_device.sh"
  for item in $1; do
    local variants="" seq=1 name keep=""
    [[ $item == *+* ]] && seq=""  # a group trains at once on the GPU (one process per head)
    for name in ${item//+/ }; do
      [[ -n "${IS_SRC[$name]:-}" ]] && keep+=" $name"  # its best head becomes a warm start
      if [[ -n "${FRESH[$name]:-}" ]]; then  # a fresh equal-tokens head
        variants+="${variants:+ }$name:${FRESH[$name]},train.max_steps=3600"
        continue
      fi
      local warm="$WORK/warm/${SRC[$name]}"
      variants+="${variants:+ }$name:${SHAPE[$name]},head.checkpoint=$warm,train.lr=${LR:-5.0e-4},train.max_steps=${STEPS:-3600}"
      echo "for i in \$(seq 360); do [ -f $warm/head.safetensors ] && break; sleep 5; done"
    done
    local out=$WORK/out_${item//+/_} base=""
    [[ $item != *+* ]] && base=$(base_of "$item")
    # the base's compile cache (this chain's, else carried in), first found first: what a run starts from
    local kept=$WORK/compile_cache/train_$base.bin.gz  # gzip'd (~1/8): an n = 6 cache is ~70 MB, too big to send
    local sources="$kept runs/compile_cache/train_$base.bin runs/compile_cache/train_$base.bin.gz"
    if [[ -n $base ]]; then  # ... copied under the run's own name
      local mine=runs/compile_cache/train_$item.bin
      echo "mkdir -p runs/compile_cache; for c in $sources; do" \
           "if [ -f \$c ] && [ ! -f $mine ]; then" \
           "case \$c in *.gz) { gzip -dc \$c > $mine.part && mv $mine.part $mine; } || rm -f $mine.part;;" \
           "*) cp \$c $mine;; esac; fi; done  # a corrupt .gz leaves no partial cache"
    fi
    echo "mkdir -p $out; echo \"[\$(date +%T)] train $item\""
    echo "OUT=$out WORK=$WORK SPD_TRAIN_DATA=${SPD_TRAIN_DATA:-runs/train_data/sharegpt.jsonl.gz}" \
         "TRAIN_SECONDS=1500 SESSION_SECONDS=1500 CACHE_RETURN_MB=0 ${seq:+SEQUENTIAL=1 }VARIANTS=\"$variants\" EXTRA=\"$RECIPE\" FETCH=1" \
         "bash scripts/gpu_train_session.sh > $WORK/train_${item//+/_}.out 2>&1"
    echo "echo \"[\$(date +%T)] train $item end rc \$?\""
    for name in $keep; do  # its best head becomes the warm start (a failed run leaves a carried one in place)
      echo "[ -f $WORK/heads/$name/best_head/head.safetensors ] && mkdir -p $WORK/warm && rm -rf $WORK/warm/$name &&" \
           "cp -r $WORK/heads/$name/best_head $WORK/warm/$name"
    done
    if [[ -n $base ]]; then  # kept when it differs from what the run started from (an unchanged one is not resent,
      # nor a carried one sent back)
      echo "src=\$(for c in $sources; do [ -f \$c ] && { echo \$c; break; }; done); if [ -f $mine ] && !" \
           "{ case \"\$src\" in *.gz) gzip -dc \"\$src\";; ?*) cat \"\$src\";; esac 2>/dev/null |" \
           "cmp -s - $mine; }; then mkdir -p $WORK/compile_cache &&" \
           "gzip -c $mine > $kept.part && mv $kept.part $kept; fi"
    fi
  done
  echo "echo \"[\$(date +%T)] CHAIN DONE\""
}

case "${1:-}" in
  start)
    CHAIN=${CHAIN:-"w2 w3 wp3 w4"}
    for item in $CHAIN; do  # a group cannot hold a fresh head and its own continuation (it would wait for itself)
      for name in ${item//+/ }; do
        [[ -n "${SRC[$name]:-}" && " ${item//+/ } " == *" ${SRC[$name]} "* ]] && {
          echo "gpu_continue_heads.sh: '$item' trains $name beside its warm start ${SRC[$name]};" \
               "put them in order: \"${SRC[$name]} $name\"" >&2; exit 2; }
      done
    done
    for name in ${CHAIN//+/ }; do
      [[ -n "${SRC[$name]:-}${FRESH[$name]:-}" ]] || {
        echo "gpu_continue_heads.sh: unknown head '$name' in CHAIN; give a fresh run (${!FRESH[*]}) or a" \
             "continuation <letter><base> (letters $RUN_LETTERS; bases ${!BASE_SHAPE[*]})" >&2; exit 2; }
    done
    if [[ -n "${DRY:-}" ]]; then chain_script "$CHAIN"; exit 0; fi
    mkdir -p "$WORK" && rm -rf "$REPO" "$REPO.tmp" && cp -r "$HERE" "$REPO.tmp" && mv "$REPO.tmp" "$REPO"
    chain_script "$CHAIN" > "$WORK/chain.sh"
    cd "$REPO" && WORK=$WORK bash scripts/gpu_detached.sh start heads bash "$WORK/chain.sh" ;;
  warm)
    mkdir -p "$WORK/warm"
    for d in "$HERE"/runs/warm*/*/; do [[ -f $d/head.safetensors ]] && cp -r "$d" "$WORK/warm/"; done
    ls "$WORK/warm" ;;
  wait)
    WORK=$WORK TAIL=10 bash "$REPO/scripts/gpu_detached.sh" wait heads "${2:-500}"
    for f in "$WORK"/heads/*/train_log.jsonl; do [[ -f $f ]] && { echo "== $f"; tail -1 "$f" | cut -c1-300; }; done
    bash "$0" fetch ;;
  fetch)
    OUT=${OUT:?set OUT} bash "$HERE/scripts/gpu_collect.sh" "$WORK" 'out_*/heads.tgz.part-*' 'out_*/log.txt' \
      'heads.log' 'compile_cache/train_*.bin.gz'
    ls -la "$OUT" ;;
  *)
    echo "usage: gpu_continue_heads.sh start | warm | wait [SECONDS] | fetch" >&2; exit 2 ;;
esac
