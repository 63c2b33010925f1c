"""The layouts that fit: every (pp, dp, cp, shard, micro-batches, checkpointing, schedule) of a GPU count, priced
per rank, those whose every stage fits the device's memory ranked by an estimated step time.

Pricing a candidate by a full dry run would build its every stage's graphs (minutes at 70B, hundreds of
candidates). Instead the graphs are built for a few small probes and each candidate is priced from them:

  state       exact arithmetic per stage (bytes a parameter costs, by shard mode, over the gradient group
              g = dp x cp; `state_bytes`), the dry run's own accounting
  activations measured by probes: a two-stage dry run (pp 2, one micro-batch) of the same model cut to
              1 and 2 layers a stage, with 1 and 2 sequences, per cp class (1, or more) and checkpointing
              (gradsched.sizing.fit_probes.search says which, 16 to 28 a class): what each stage's forward
              left alive (saved) and the most its step held above that (rest), each fitted as
                  fixed + per_layer x L + per_sequence x u + per_layer_sequence x L x u
              separately for the first stage (embedding) and the last (head and loss). A candidate's stage
              s with L layers and u sequences per micro-batch holds k micro-batches' saved activations at
              once (from torch's order, `in_flight`: min(m, pp - s) under 1F1B, m under GPipe), so its peak is
                  state + k x saved(L, u) + rest(L, u)
                  + the pipeline stage's receive buffers (m micro-batches of its input and output gradient)
                  + the device runtime's buffers
              per local token: probes at cp 2 price every cp > 1 (the ring's buffers are per local token).
              With m > 1 each micro-batch's gradients are summed, whole, until the step's reduction: a backward
              before the last holds them and the new ones with k micro-batches in flight, the last feeds them
              to the reductions with one; probes with three micro-batches measure both peaks above their
              micro-batches in flight (accumulating, final; gradsched.sizing.roles.Role), fitted the same way, and
              the stage's activations are the largest of the three moments:
                  max(k x saved + rest, k x saved + accumulating, saved + final)
              A peak is a maximum over moments, not a sum: a sum of 1- and 2-layer probes' terms missed a
              10-layer stage's accumulated gradients by 27% at 70B.
              zb1p: B keeps what its W will read (its stash, measured: about what a forward without
              checkpointing saves; a checkpointed B recomputes it first, and keeps more: llama-70b's 10 layers,
              7.6 GiB against 0.34 saved), so a micro-batch holds its saved activations from its forward to
              its B, and its stash from its B to its W. torch's ZB-H1 order has stage s hold up to
              (pp - s) of the first and s of the second (1F1B: (pp - s, 0)); `in_flight` counts them at each
              backward (f, w). Probes with three micro-batches under zb1p measure the step's peak above them
              (zero_bubble) and the stash, checkpointed or not: a stage's activations are max over its
              backwards of
                  f x saved + w x stash + zero_bubble

The ranking's cost, stated: estimated step time = compute / (1 - bubble) + bytes / bandwidth, with
  compute = (6, or 8 with checkpointing) x the largest stage's parameters x tokens per rank per step / flops
  bubble  = (pp - 1) / (m + pp - 1)                                    (1F1B and GPipe alike)
            (pp - 1) / (3 m + pp - 1)                                  (zb1p: W fills all but T_F + T_B - T_W
                                                                        of each stage's wait, F, B, W equal;
            (pp - 1) / (2 m + pp - 1)                                   checkpointed, B = 2 F: it recomputes)
  bytes   = what one rank sends per step: gradient reduce-scatter (g - 1)/g x stage parameters x dtype bytes;
            the parameters' all-gather once a step (shard=True) or in every micro-batch's forward and
            backward (shard="params"); a tie's all-reduce (2 x the tied weight, pp > 1); the activations
            and their gradients between stages; the ring's K and V (cp - 1 steps a layer, forward and twice
            in the backward)
  tp      the state of each TP rank: its shard of every matrix (embedding and head vocab-parallel), the norms
          whole; the activations from probes at that tp (sequence parallelism keeps most of them 1/tp); compute
          1/tp of the stage's; plus sequence parallelism's collectives (`_tp_bytes`) over the node's bandwidth
          (--tp-bandwidth); under cp too, where each TP rank's ring passes its own heads' K and V.
No overlap of communication with compute is assumed: an upper bound, comparable between candidates.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

SHARDS = ("params", True)
SCHEDULES = ("1f1b", "zb1p")


@dataclass(frozen=True)
class Candidate:
    pp: int
    dp: int
    cp: int
    shard: object
    microbatches: int
    checkpointing: bool
    schedule: str = "1f1b"  # or "zb1p" (pp > 1): each backward as B and W, W in the bubble
    tp: int = 1  # tensor parallelism (with sequence parallelism): the fastest dimension, inside a node


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    kv_dim: int  # key/value heads x head dim
    vocab: int
    layer_params: int  # one decoder layer's parameters
    first_params: int  # the embedding (and what else the first stage holds outside its layers)
    last_params: int  # the head (a copy of a tied embedding under pp > 1) and the final norm
    tied: bool
    dtype_bytes: int
    layer_replicated: int = 0  # of a layer's parameters, those every TP rank holds whole (its norms)
    last_replicated: int = 0  # the final norm's
    heads: int = 0
    kv_heads: int = 0


@dataclass
class Priced:
    candidate: Candidate
    peak: int  # the largest stage's, bytes
    stage: int
    state: int  # that stage's parameters, gradients, masters and optimizer state
    bytes_per_step: int
    bubble: float
    step_s: float
    fits: bool
    tp_bytes_per_step: int = 0  # of bytes_per_step, sequence parallelism's collectives (inside a node)

    def row(self) -> dict:
        return {**asdict(self.candidate), **{k: v for k, v in asdict(self).items() if k != "candidate"}}


def candidates(gpus: int, layers: int, seq: int, global_batch: int, max_cp: int = 8,
               checkpointing=(False, True), max_microbatch_choices: int = 3,
               schedules=SCHEDULES, tps=(1,)) -> list[Candidate]:
    """Every layout of `gpus` ranks: pp a power of two up to the layers, cp a power of two up to max_cp that
    splits the sequence into 2 x cp chunks (load balance), tp each of `tps` (`tp_sizes` says which the model's
    heads allow), dp the rest dividing the global batch; the
    micro-batch counts the fewest that keep every stage busy in 1F1B (m >= pp), a few of them; at pp > 1 each
    of `schedules` that runs with those micro-batches (zb1p: m >= pp, in rounds of equal size); at pp 1 one
    candidate (no pipeline, no schedule)."""
    from gradsched.training.pipeline_schedule import resolve_schedule
    out = []
    for pp, cp, tp in itertools.product(_powers(min(layers, gpus)), _powers(max_cp), tps):
        if gpus % (pp * cp * tp) or seq % (2 * cp) or (seq // cp) % tp:
            continue
        dp = gpus // (pp * cp * tp)
        if global_batch % dp:
            continue
        b = global_batch // dp
        ms = [m for m in range(1, b + 1) if b % m == 0 and m >= min(pp, b)][:max_microbatch_choices]
        for m, shard, ckpt, schedule in itertools.product(ms, SHARDS, checkpointing, schedules):
            if pp == 1 and schedule != schedules[0]:  # no pipeline: one candidate, whatever the schedules
                continue
            try:  # "1f1b" as parallelize's "auto": GPipe with fewer micro-batches than stages
                out.append(Candidate(pp, dp, cp, shard, m, ckpt, "1f1b" if pp == 1 else
                                     resolve_schedule("auto" if schedule == "1f1b" else schedule, pp, m), tp))
            except ValueError:
                pass  # the schedule does not run m micro-batches at this pp
    return out


def tp_sizes(shape: ModelShape, most: int = 8) -> tuple[int, ...]:
    """The tensor-parallel sizes the fit tries: powers of two up to `most` (a node's GPUs) that divide the query
    heads, and the key/value heads or are a multiple of them (fewer key/value heads than tp: each rank reads
    the group its queries use)."""
    return tuple(t for t in _powers(most) if shape.heads % t == 0 and
                 (shape.kv_heads % t == 0 or t % shape.kv_heads == 0))


def in_flight(stage: int, pp: int, m: int, schedule: str) -> list[tuple[int, int]]:
    """When each of stage's backwards starts, in torch's order for the schedule: (micro-batches whose forward ran
    and backward did not, those whose B ran and W did not). A B keeps what its W reads (under zb1p; measured:
    about all a forward without checkpointing saves, which a checkpointed B recomputes first). 1F1B: up to
    (min(m, pp - stage), 0); GPipe (m, 0); ZB-H1 up to (pp - stage, stage) at m >= pp."""
    from gradsched.training.pipeline_schedule import schedule_order
    forwards = backwards = weights = 0
    out = []
    for kind, _ in schedule_order(stage, pp, m, schedule):
        if kind == "F":
            forwards += 1
        elif kind == "B":
            out.append((forwards - backwards, backwards - weights if schedule == "zb1p" else 0))
            backwards += 1
        else:
            weights += 1
    return sorted(set(out))


def _powers(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length()) if 1 << k <= n]


def state_bytes(params: int, shard, g: int, d: int) -> int:
    """What a rank holds for `params` parameters when its optimizer steps (AdamW, fp32 masters and moments),
    as gradsched holds it: shard=True whole parameters, the rest 1/g (fp32 master shards of its own); "params"
    everything 1/g (a fp32 parameter shard is its own master); d the parameters' dtype bytes."""
    per = {True: d + (d + 4 + 8) / g, "params": (d + d + (4 if d < 4 else 0) + 8) / g, False: d + d + 2 * d}[shard]
    return int(params * per)


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per stage of the dry run's even split (gradsched.dryrun.even_split_points)."""
    cuts = [0] + [layers * k // pp for k in range(1, pp)] + [layers]
    return [b - a for a, b in zip(cuts, cuts[1:])]


@dataclass(frozen=True)
class Fitted:
    """Activation bytes of one stage end: fixed + per_layer L + (per_seq + per_layer_seq L) u."""
    fixed: float
    per_layer: float
    per_seq: float
    per_layer_seq: float

    def at(self, layers: int, seqs: float) -> float:
        return self.fixed + self.per_layer * layers + (self.per_seq + self.per_layer_seq * layers) * seqs


@dataclass(frozen=True)
class End:
    """A stage end's activations: what one micro-batch's forward leaves alive (held once per micro-batch in
    flight) and the most the step holds above that (once); with m > 1, a backward's peak above the micro-batches
    in flight at its start: one accumulating (all but the last) and the last (see gradsched.sizing.roles.Role)."""
    saved: Fitted
    rest: Fitted
    accumulating: Fitted | None = None
    final: Fitted | None = None
    zero_bubble: Fitted | None = None  # zb1p: the step's peak above its micro-batches in flight (in_flight)
    stash: Fitted | None = None  # zb1p: what a B keeps for its W (measured: its probes' Role.stash)

    def at(self, layers: int, seqs: float, in_flight: int) -> float:
        return in_flight * self.saved.at(layers, seqs) + self.rest.at(layers, seqs)

    def zero_bubble_at(self, layers: int, seqs: float, held: list) -> float:
        saved, stash = self.saved.at(layers, seqs), self.stash.at(layers, seqs)
        return max(f * saved + w * stash for f, w in held) + self.zero_bubble.at(layers, seqs)

    def zero_bubble_layers(self, layers: int, seqs: float, held: list, last: "End") -> float:
        """A middle stage under zb1p: the layers' terms alone, of the last end's B and W (the first stage's B
        computes no input gradient: its W does all the work, and its B keeps nothing for it)."""
        saved, stash = _layers(self.saved, layers, seqs), _layers(last.stash, layers, seqs)
        return max(f * saved + w * stash for f, w in held) + _layers(last.zero_bubble, layers, seqs)

    def layers_only(self, layers: int, seqs: float, in_flight: int) -> float:
        """A middle stage: the layers' terms alone."""
        s, r = self.saved, self.rest
        return layers * (in_flight * (s.per_layer + s.per_layer_seq * seqs) + r.per_layer + r.per_layer_seq * seqs)


def _layers(f: Fitted, layers: int, seqs: float) -> float:
    return layers * (f.per_layer + f.per_layer_seq * seqs)


def fit_points(t11: float, t21: float, t12: float, t22: float) -> Fitted:
    """The bilinear fit through transients measured at (layers, sequences) = (1,1), (2,1), (1,2), (2,2)."""
    per_layer_seq = (t22 - t12) - (t21 - t11)
    per_layer = (t21 - t11) - per_layer_seq
    per_seq = (t12 - t11) - per_layer_seq
    return Fitted(t11 - per_layer - per_seq - per_layer_seq, per_layer, per_seq, per_layer_seq)


def price(c: Candidate, shape: ModelShape, fits: dict, seq: int, global_batch: int, memory: int, runtime: int,
          flops: float, bandwidth: float, tp_bandwidth: float | None = None) -> Priced:
    """A candidate's worst stage and its cost (see the module docstring). `fits`: probe key -> (first, last), from
    probes at the candidate's tp; `tp_bandwidth`: a rank's bytes/s inside its node (default `bandwidth`)."""
    from gradsched.training.pipeline_schedule import resolve_schedule  # "1f1b" as "auto" runs it: GPipe if m < pp
    first, last = fits[(c.cp > 1, c.checkpointing, c.shard)]
    g, d, m = c.dp * c.cp, shape.dtype_bytes, c.microbatches
    u = global_batch // c.dp / m  # sequences per micro-batch
    tokens = u * seq / c.cp  # a rank's tokens per micro-batch
    boundary = tokens * shape.hidden * d  # one micro-batch's activations between stages
    worst = None
    head = shape.last_params - (shape.vocab * shape.hidden if shape.tied and c.pp == 1 else 0)  # pp 1: one copy
    for s, layers in enumerate(stage_layers(shape.layers, c.pp)):
        params = layers * shape.layer_params + (shape.first_params if s == 0 else 0) + (head if s == c.pp - 1 else 0)
        whole = layers * shape.layer_replicated + (shape.last_replicated if s == c.pp - 1 else 0)
        params = (params - whole) // c.tp + whole  # a TP rank's: its shard of every matrix, the norms whole
        held = in_flight(s, c.pp, m, resolve_schedule("auto", c.pp, m) if c.schedule == "1f1b" else c.schedule)
        k = max(f for f, _ in held)
        seqs = u * 2 / c.cp if c.cp > 1 else u  # the probes' sequences holding as many local tokens
        if c.schedule == "zb1p":  # its probes' peaks above their micro-batches in flight (the backwards' included)
            act = (first.zero_bubble_at(layers, seqs, held) if s == 0 else last.zero_bubble_at(layers, seqs, held)
                   if s == c.pp - 1 else first.zero_bubble_layers(layers, seqs, held, last))
        elif c.pp == 1:  # both ends, the layers counted once (the first's); their rests are one step's: the larger
            act = k * (first.saved.at(layers, seqs) + last.saved.at(0, seqs)) + \
                max(first.rest.at(layers, seqs), last.rest.at(0, seqs))
        elif s == 0:
            act = first.at(layers, seqs, k)
        elif s == c.pp - 1:
            act = last.at(layers, seqs, k)
        else:
            act = first.layers_only(layers, seqs, k)
        if m > 1 and c.schedule != "zb1p":  # gradients accumulated whole until the step's reduction: the backwards' own peaks may be higher
            act = max(act, *_backward_peaks(first, last, s, c.pp, layers, seqs, k))
        act += (m * boundary if s > 0 else 0) + (m * boundary if s < c.pp - 1 else 0)
        state = state_bytes(params, c.shard, g, d)
        peak = int(state + max(act, 0) + runtime)
        if worst is None or peak > worst[0]:
            worst = (peak, s, state, params)
    peak, s, state, _ = worst
    biggest = (max(layers * shape.layer_params for layers in stage_layers(shape.layers, c.pp)) +
               max(shape.first_params, shape.last_params)) // c.tp
    # W fills the bubble: (pp - 1) x (T_F + T_B - T_W) idle of m x (T_F + T_B + T_W), the three taken equal (a
    # checkpointed B recomputes its forward: twice as long)
    bubble = (c.pp - 1) / (((2 if c.checkpointing else 3) * m if c.schedule == "zb1p" else m) + c.pp - 1)
    compute = (8 if c.checkpointing else 6) * biggest * tokens * m / flops
    moved = _bytes_moved(c, shape, biggest, tokens, boundary)
    tp_moved = _tp_bytes(c, shape, tokens)
    return Priced(c, peak, s, state, moved + tp_moved, round(bubble, 4),
                  compute / (1 - bubble) + moved / bandwidth + tp_moved / (tp_bandwidth or bandwidth), peak <= memory,
                  tp_moved)


def _backward_peaks(first: End, last: End, s: int, pp: int, layers: int, seqs: float, k: int) -> tuple:
    """Stage s's peaks in an accumulating backward (k micro-batches in flight at its start) and in its last (one).
    Each is a backward's peak above the micro-batches in flight, plus those micro-batches' saved activations."""
    if 0 < s < pp - 1:  # a middle stage: the layers' terms of the first stage's
        acc, final, saved = (_layers(f, layers, seqs) for f in (first.accumulating, first.final, first.saved))
    else:  # the stage's ends, its layers counted once (with the first end's; pp 1 holds both ends)
        ends = [(first, layers), (last, 0)] if pp == 1 else [(first, layers)] if s == 0 else [(last, layers)]
        acc, final, saved = (sum(getattr(e, part).at(n, seqs) for e, n in ends)
                             for part in ("accumulating", "final", "saved"))
    return k * saved + acc, saved + final


def _bytes_moved(c: Candidate, shape: ModelShape, params: int, tokens: float, boundary: float) -> int:
    g, d, m = c.dp * c.cp, shape.dtype_bytes, c.microbatches
    share = (g - 1) / g
    moved = share * params * d  # the gradients' reduce-scatter
    moved += share * params * d * (2 * m if c.shard == "params" else 1)  # the parameters' all-gathers
    if shape.tied and c.pp > 1:
        moved += 2 * shape.vocab * shape.hidden * d
    if c.pp > 1:
        moved += 2 * m * boundary
    if c.cp > 1:  # each layer: K and V passed cp - 1 times forward, K, V and their gradients backward
        # of its TP rank's heads: 1/tp of them, or the one key/value head its queries read (fewer than tp)
        kv = tokens * shape.kv_dim / (min(c.tp, shape.kv_heads) if shape.kv_heads else c.tp) * 2 * d
        moved += 3 * (c.cp - 1) * kv * m * max(stage_layers(shape.layers, c.pp))
    return int(moved)


def _tp_bytes(c: Candidate, shape: ModelShape, tokens: float) -> int:
    """What sequence parallelism sends a step on the busiest stage (Megatron's count): per layer and micro-batch
    two all-gathers and two reduce-scatters of the [tokens, hidden] activations forward and their conjugates
    backward, each (tp - 1) / tp of it; the embedding's reduce-scatter and the head's all-gather, both ways; the
    replicated parameters' gradients summed over tp once a step."""
    if c.tp == 1:
        return 0
    share, d, m = (c.tp - 1) / c.tp, shape.dtype_bytes, c.microbatches
    act = share * tokens * shape.hidden * d
    layers = max(stage_layers(shape.layers, c.pp))
    ends = 4 * act if c.pp == 1 else 2 * act  # the embedding's and the head's: on one stage only at pp > 1
    grads = 2 * share * (layers * shape.layer_replicated + shape.last_replicated) * d
    return int(m * (8 * layers * act + ends) + grads)


def model_shape(causal_lm, dtype_bytes: int) -> ModelShape:
    """The parameter counts `price` needs, from a gradsched.hf.CausalLM (a Hugging Face *ForCausalLM)."""
    hf = causal_lm.model
    c = hf.config
    count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    body = hf.get_decoder() if hasattr(hf, "get_decoder") else hf.model
    head = hf.get_output_embeddings()
    norm = getattr(body, "norm", None)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    norms = lambda mod: sum(p.numel() for name, m in mod.named_modules() if "norm" in type(m).__name__.lower()  # noqa: E731
                            for p in m.parameters(recurse=False))
    return ModelShape(layers=c.num_hidden_layers, hidden=c.hidden_size,
                      kv_dim=getattr(c, "num_key_value_heads", c.num_attention_heads) * head_dim,
                      vocab=c.vocab_size, layer_params=count(body.layers[0]),
                      first_params=count(body.embed_tokens),
                      last_params=head.weight.numel() + (count(norm) if norm is not None else 0),
                      tied=bool(getattr(c, "tie_word_embeddings", False)), dtype_bytes=dtype_bytes,
                      layer_replicated=norms(body.layers[0]), last_replicated=norms(norm) if norm is not None else 0,
                      heads=c.num_attention_heads, kv_heads=getattr(c, "num_key_value_heads", c.num_attention_heads))
