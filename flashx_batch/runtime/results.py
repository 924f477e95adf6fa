"""What `generate` returns: one `RequestOutput` per prompt, and the call's `GenerateStats`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length"
    num_input_tokens: int
    truncated: bool = False  # long_input=truncate dropped the head of the prompt
    sample_index: int = 0  # which of the prompt's `SamplingParams.n` samples this is
    # SamplingParams.logprobs=K only (None otherwise), one entry per token of `token_ids`: the token's
    # logprob under the raw model distribution (before temperature / top-k / top-p), and the K most
    # likely (token id, logprob) pairs at that step, most likely first
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # a constrained row only (None otherwise): the text matches its constraint. True whenever finish_reason
    # is "stop"; a row cut at max_new_tokens ("length") is True only if its text happens to be a whole match
    constraint_met: bool | None = None
    # a json_schema row fitted to its budget (`SamplingParams.json_fit_budget`) only: a string or array of the
    # answer reached a bound the fitting added, so the model may have had more to write there
    json_bound_reached: bool | None = None

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class GenerateStats:
    """Figures for one `generate` call (the runner turns them into per-shard stats rows)."""

    rows: int = 0
    batches: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    computed_slots: int = 0  # token positions the model actually ran, padding included
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    kv_bytes_peak: int = 0  # bytes of the segments held at the fullest moment
    kv_bytes_arena: int = 0
    kv_bytes_static_peak: int = 0  # what a static cache would have held for the same rows
    cached_prompt_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed
    prefix_tokens_computed: int = 0  # shared-prefix tokens computed once and cached
    batch_sizes: list[int] = field(default_factory=list)
    peak_rows: int = 0  # the most rows decoding at once (batch_growth and refill can exceed a batch's start)
    relayouts: int = 0  # times a batch moved its live KV: stripes re-cut for more, shorter rows, or extents compacted
    row_latency_s: list[float] = field(default_factory=list)  # per row: its prefill start -> its last token
    grammar_compiles: int = 0  # constraints compiled during the call (the engine caches them across calls)

    @property
    def padding_efficiency(self) -> float:
        """Useful ÷ computed token slots. Useful: the prompt tokens actually computed (prefix-cache hits
        are not computed at all) plus all but one generated token per row (the last sampled token is
        never fed back through the model)."""
        useful = self.prefill_tokens_computed + self.output_tokens - self.rows
        return useful / self.computed_slots if self.computed_slots else 1.0

    @property
    def prefill_tokens_computed(self) -> int:
        """Prompt tokens run through the model: each row's own part plus shared prefixes once."""
        return self.input_tokens - self.cached_prompt_tokens + self.prefix_tokens_computed

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict:
        return {
            "rows": self.rows, "batches": self.batches, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens, "padding_efficiency": self.padding_efficiency,
            "prefill_s": self.prefill_s, "decode_s": self.decode_s, "wall_s": self.wall_s,
            "output_tok_per_s": self.output_tok_per_s, "kv_bytes_peak": self.kv_bytes_peak,
            "kv_bytes_arena": self.kv_bytes_arena,
            "kv_bytes_static_peak": self.kv_bytes_static_peak,
            "max_batch_size": max(self.batch_sizes + [self.peak_rows]), "relayouts": self.relayouts,
            "decode_steps": self.decode_steps, "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "prefix_hit_rate": self.cached_prompt_tokens / self.input_tokens if self.input_tokens else 0.0,
        }


class KVAccount:
    """The figures batch layouts report into a call's `GenerateStats` (KV held, re-cuts, prefix tokens)."""

    def __init__(self, stats: GenerateStats, segment_bytes: int) -> None:
        self.stats, self.segment_bytes = stats, segment_bytes

    def kv(self, segments_held: int, static_segments: int) -> None:
        s = self.stats
        s.kv_bytes_peak = max(s.kv_bytes_peak, segments_held * self.segment_bytes)
        s.kv_bytes_static_peak = max(s.kv_bytes_static_peak, static_segments * self.segment_bytes)

    def relayout(self) -> None:
        self.stats.relayouts += 1

    def cached_prompt_tokens(self, count: int) -> None:
        self.stats.cached_prompt_tokens += count

    def prefix_tokens(self, count: int) -> None:
        self.stats.prefix_tokens_computed += count
