"""The job configuration's sections as dataclasses: every field with its type, default and
documentation (the string under it, which ``--help`` shows), and the rules between values that the
validation and the modules applying them share. Imports nothing of the package but
:mod:`torchtitan_lite.errors`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ActivationCheckpoint", "Checkpoint", "Comm", "Compile", "DPO", "DataSource", "Debug", "Float8", "GRPO",
           "Job", "JobConfig", "LOADABLE_PARTS", "LRScheduler", "Lora", "Metrics", "MoEConfig", "Model", "Optimizer",
           "Parallelism", "Profiling", "RESHARD_MODES", "Training", "Validation", "every_nth_block",
           "float8_recipe_problem", "lora_settings_problem"]


RESHARD_MODES = ("default", "always", "never")
"""The named reshard modes (besides an integer group size, a per-unit plan and the config's ``auto``)."""


# Rules that the config's validation and the modules that apply the settings (for research code
# calling them directly) share: each says what is wrong, or None.

def lora_settings_problem(rank: Any, alpha: Any, dropout: Any) -> tuple[str, Any, str] | None:
    """The first ``[lora]`` number that is not allowed: (key, value, what is allowed)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        return "lora.rank", rank, "expected an integer >= 1"
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha > 0):
        return "lora.alpha", alpha, "expected a finite number > 0"
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        return "lora.dropout", dropout, "expected 0 <= dropout < 1"
    return None


def every_nth_block(option: Any) -> int | None:
    """``activation_checkpoint.selective_ac_option``: None for ``"op"``, N for a positive integer
    (or its string); ``ValueError`` naming the key for anything else."""
    if option == "op":
        return None
    text = str(option).strip()
    if isinstance(option, bool) or not text.isdigit() or int(text) < 1:
        raise ValueError(f"activation_checkpoint.selective_ac_option: invalid value {option!r}; expected 'op' or a "
                         "positive integer N (full recomputation of every N-th block)")
    return int(text)


def float8_recipe_problem(recipe_name: str | None, all_gather: bool) -> str | None:
    """What is wrong with a float8 recipe beside the float8 all-gather (which needs tensorwise
    scales), or None."""
    if recipe_name not in (None, "tensorwise") and all_gather:
        return (f"float8.recipe_name: invalid value {recipe_name!r}; expected unset or tensorwise with "
                "float8.enable_fsdp_float8_all_gather = true (the float8 all-gather needs tensorwise scales)")
    return None


# --------------------------------------------------------------------------------------------
# Sections. The string under each field is its documentation (shown by --help).
# --------------------------------------------------------------------------------------------


@dataclass
class Job:
    config_file: str | None = None
    """TOML file with the job's settings; command-line overrides are applied on top."""
    dump_folder: str = "./outputs"
    """Folder for everything the job writes (metrics, TensorBoard logs)."""
    description: str = "default job"
    """Free-text description of the job, logged at start."""
    print_config: bool = False
    """Log the fully resolved configuration at start (rank 0)."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family: one of the registered models (``--help`` lists them; a model of one's own joins them with
    torchtitan_lite.models.register_model_spec)."""
    flavor: str = "debugmodel"
    """Model shape within the family (``--help`` lists each registered family's), or "from_checkpoint": the
    shape of checkpoint.initial_load_path (a Hugging Face folder's config.json, or the model_args of one of
    our step folders), of any size."""
    tokenizer_path: str | None = None
    """A Hugging Face tokenizer.json (or a folder holding one); unset: the byte-level tokenizer (258 ids,
    needs no files)."""
    vocab_size: int = -1
    """Rows of the embedding and output layers; -1 follows the tokenizer. A larger value pads the vocabulary
    (e.g. to a multiple of 64); a smaller one is an error."""
    attention_mask: Literal["causal", "block_causal"] = "causal"
    """causal: every token attends to all before it in its window; block_causal: only to those of its own
    sample (document or conversation) in a packed window, with RoPE positions restarting at each sample
    (TorchTitan's attn_mask_type)."""
    converters: list[Literal["float8", "quantize.linear.float8"]] = field(default_factory=list)
    """Conversions of the model before it is sharded: float8 (TorchTitan's later name: quantize.linear.float8)
    trains the blocks' linears in float8 through torchao, with the [float8] options; needs a CUDA GPU of
    compute capability 8.9 or later, or float8.emulate."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "AdamW8bit"] = "AdamW"
    """Optimizer class. AdamW8bit: torchao's AdamW whose two moments are stored in 8 bits (blocks of 256
    values, each with an fp32 scale; tensors under 4,096 values stay fp32): about 2 bytes of state a
    parameter instead of 8, for full fine-tunes on small GPUs (its step is compiled by torchao; implementation
    is not used)."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = 0.9
    """Adam beta1 (first-moment decay)."""
    beta2: float = 0.95
    """Adam beta2 (second-moment decay)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW) or L2 penalty (Adam), applied to weight matrices and embeddings."""
    weight_decay_norms_and_biases: bool = False
    """Also apply weight decay to 1-D parameters (norm scales, biases); off, as is usual."""
    implementation: Literal["foreach", "fused", "for-loop"] = "foreach"
    """Optimizer kernel: foreach (multi-tensor), fused (single kernel; on devices PyTorch has fused Adam
    kernels for) or for-loop."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup up to optimizer.lr: step s (from 0) runs at lr · (s + 1) / warmup_steps."""
    decay_ratio: float | None = None
    """Fraction of the schedule's steps spent decaying at the end (warmup-stable-decay: round(total_steps ·
    decay_ratio) steps); unset: decay over all steps after warmup. As in TorchTitan, the decay ends one
    step after the last one, so the last step runs just above the minimum."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay phase."""
    min_lr_factor: float = 0.0
    """Learning rate at the end of decay, as a fraction of optimizer.lr."""
    total_steps: int | None = None
    """Steps the schedule spans; unset: training.steps. Set it to stop a run early on the schedule of a longer one."""


@dataclass
class DataSource:
    """One table of ``[[training.datasets]]`` or ``[[validation.datasets]]``."""

    name: str = ""
    """Name of the source in metrics (tokens/NAME, loss/NAME, validation/NAME/loss) and logs; unique."""
    dataset: str = ""
    """Its kind: any value training.dataset takes (python_stdlib, text, tokens, parquet, arrow, ...)."""
    dataset_path: str | None = None
    """File or folder it reads (the kinds that read one)."""
    weight: float = 1.0
    """Training only: its share of the samples, a number > 0 (the weights are normalised to sum to 1)."""
    max_epochs: int | None = None
    """Training only: after this many epochs of its own the source leaves the mixture (the others' weights are
    normalised again); unset: it starts again when used up, as long as the run goes on."""


@dataclass
class Training:
    objective: str = "auto"
    """What the steps optimise: auto (DPO's pair loss on preference data, GRPO on prompts, else the token
    loss), token, dpo, grpo, or a dotted path module.ENTRY to an objective entry of one's own
    (docs/research.md)."""
    objective_options: dict[str, Any] = field(default_factory=dict)
    """Settings of an objective of one's own, as a TOML table ([training.objective_options]) or a JSON object
    on the command line; the objective reads them."""
    local_batch_size: int = 8
    """Samples per rank per micro-batch (one forward/backward)."""
    global_batch_size: int = -1
    """Samples per optimizer step over all ranks; -1 means local_batch_size × data-parallel degree. A multiple
    of that gives gradient accumulation."""
    seq_len: int = 2048
    """Tokens per sample (the model is fed seq_len tokens and predicts the next seq_len)."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    steps: int = 10000
    """Number of optimizer steps."""
    dataset: str = "python_stdlib"
    """python_stdlib (embedded default: this Python's standard-library sources, no download),
    python_stdlib_validation (held-out part of it), text (.txt/.jsonl/.jsonl.gz files, tokenized at
    start-up), tokens (pre-tokenized .bin/.npy files), chat (conversations for fine-tuning), preference
    (prompt / chosen / rejected pairs, TRL's format: trains with DPO, [dpo]), parquet (.parquet files,
    streamed) or arrow (a Hugging Face datasets save_to_disk folder or .arrow files, streamed).
    TorchTitan's names also work with local files: c4_test (its tests/assets/c4_test, from the working
    directory), c4 and c4_validation (dataset_path = a local copy of allenai/c4's JSON-lines shards; read
    at start-up)."""
    dataset_path: str | None = None
    """File or folder read by the text, tokens, parquet and arrow datasets (folders are searched recursively)."""
    dataset_text_column: str = "text"
    """Column holding the documents in parquet and arrow datasets (training and validation)."""
    dataset_token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Dtype of raw .bin token files (.npy files carry their own)."""
    datasets: list[DataSource] = field(default_factory=list)
    """A weighted mixture instead of training.dataset: [[training.datasets]] tables in the TOML file, each
    with name, dataset, dataset_path, weight and optionally max_epochs. Sample-level and deterministic:
    after k steps each source has within one sample of weight × k × global_batch_size samples, on any world
    size."""
    loss_on: Literal["assistant", "all"] = "assistant"
    """For chat data (dataset = "chat"): which tokens the loss counts: the assistant turns only (the rest are
    ignored), or all; the loss is the mean over the counted tokens of the global batch."""
    truncate: Literal["right", "drop"] = "right"
    """For chat data: a conversation longer than seq_len + 1 tokens is cut at the right, or dropped (counted
    and logged either way)."""
    chat_template: str | None = None
    """For chat data: a .jinja chat template file to render every conversation with, instead of the
    tokenizer's own (chat_template.jinja beside it, else tokenizer_config.json's chat_template): e.g. a
    training template that marks the assistant's text with {% generation %} ... {% endgeneration %}."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """For chat data: variables for the chat template, as apply_chat_template's keyword arguments pass them: a
    TOML table ([training.chat_template_kwargs] enable_thinking = false; date_string = "01 Jan 2026" for Llama
    3.1's), or a JSON object on the command line. Not the names the renderer sets itself (messages, tools,
    documents, add_generation_prompt)."""
    chat_cache_dir: str = "chat_cache"
    """For chat data: where the rendered and tokenized conversations are kept (memory-mapped), made once by the
    ranks of each node on their shares and reused by restarts, other world sizes and other settings of seq_len,
    truncate and packing; relative to job.dump_folder unless absolute (point jobs on the same data at one
    folder to share it); "" renders and tokenizes every conversation on every rank at each start."""
    on_bad_row: Literal["stop", "skip"] = "stop"
    """For chat, preference and prompts data (and grpo.rollouts_path): a row that cannot be used (a line that
    is not JSON, a row not in the source's format, one the chat template refuses, a conversation whose
    assistant turns cannot be found with certainty): stop the job with one line naming the file and the row
    (exit 3), or skip it (the skipped rows are counted in the log)."""
    tiled_loss: bool = False
    """Compute the output projection and the loss over tiles of rows (each tile's logits made again in
    backward), so that the whole (tokens × vocabulary) logits and their gradient never exist: at 262,144
    tokens a rank and Llama 3's 128,256 ids they would be 63 GiB each in bf16 (docs/long-context.md). For the
    token loss and DPO; not with tensor parallel, pipeline parallel or online RL yet."""
    packing: Literal["greedy", "bfd"] = "greedy"
    """For chat data: how whole conversations fill the windows of seq_len + 1 tokens: greedy (in order; one
    that does not fit in what is left of a window starts the next) or bfd (best-fit decreasing: longest
    first, each into the window it fills most tightly; less padding, order not kept)."""
    shuffle: bool = True
    """Read each epoch in a seeded order (debug.seed): windows of text and token files permuted per epoch;
    streamed Parquet/Arrow rows by row groups in a permuted order through a buffer of
    training.shuffle_buffer documents. false: file order."""
    shuffle_buffer: int = 1000
    """Documents a streamed (parquet/arrow) source holds per sample lane to draw its next document from, when
    training.shuffle is on."""
    allow_mixture_change: bool = False
    """Resume a checkpoint whose [[training.datasets]] weights, max_epochs or sources differ from this
    config's: the new mixture applies from the resumed step (logged). false: such a resume is refused."""
    gc_freq: int = 50
    """Python's automatic garbage collection is off during training; collect every this many steps (so step
    times do not jitter)."""
    on_nonfinite: Literal["stop", "skip", "rollback"] = "stop"
    """When a step's loss or gradient norm is not finite its update is never applied; then: stop (one line
    naming the step, exit 5), skip (go on to the next batch; the step still counts: its batch is consumed,
    the LR schedule advances and it uses up one of training.steps, so step N always reads global batch N;
    logged with skipped = 1), or rollback (reload the last checkpoint of this run and go on from there
    without the batch that diverged; needs checkpoint.enable)."""
    max_rollbacks: int = 3
    """With on_nonfinite = "rollback": stop (exit 5) when a run would roll back more often than this."""
    enable_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on CPU (FSDP2 CPUOffloadPolicy)."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of all-gathered parameters and of compute; sharded parameters and optimizer state stay float32
    (float16 is not offered: it would need loss scaling)."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype in which gradients are reduced across ranks."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 0
    """Replicas (HSDP outer dimension); >1 gives a 2-D (replicate × shard) mesh; -1 means the rest of the
    world; 0 (default): one replica per node, i.e. shard within a node and replicate across nodes (plain
    FSDP on one node; set 1 to shard over every rank of every node)."""
    data_parallel_shard_degree: int = -1
    """Ranks each parameter is sharded over; -1 means the rest of the world."""
    tensor_parallel_degree: int = 1
    """Ranks each layer's projections are split over (the mesh's innermost dimension, tp), with sequence
    parallel for the norms and the residual stream. Above 1 only for a model family whose parallelize
    splits its layers; the data-parallel degrees fill the rest of the world."""
    disable_loss_parallel: bool = False
    """With tensor parallel: gather the logits before the loss (by default they stay split over the vocabulary
    and the loss reduces across the tensor-parallel ranks)."""
    enable_async_tensor_parallel: bool = False
    """With tensor parallel on CUDA and compile.enable: overlap the tensor-parallel collectives with the
    matmuls (inductor's micro-pipelined TP over symmetric memory)."""
    context_parallel_degree: int = 1
    """Ranks each sequence is split over (the mesh's cp dimension), in 2 × degree load-balanced chunks: long
    sequences whose activations one rank cannot hold. Parameters are sharded over data_parallel_shard_degree ×
    context_parallel_degree."""
    context_parallel_method: Literal["allgather", "ulysses"] = "allgather"
    """How attention sees the whole sequence: allgather (every rank gathers the keys and values: any mask,
    causal, packed documents, chat SFT) or ulysses (all-to-all from sequence shards to head groups and back:
    the heads per tensor-parallel rank must divide by the degree)."""
    expert_parallel_degree: int = 1
    """Ranks a mixture-of-experts layer's experts are spread over, borrowed from data_parallel_shard_degree ×
    context_parallel_degree (which it must divide). Above 1 only for a model family whose parallelize
    handles it."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages' ranks (the mesh's outermost dimension, pp): the model's blocks split into stages run by
    pipeline_parallel_schedule over micro-batches of each local batch (docs/parallelism.md)."""
    pipeline_parallel_schedule: str = "1F1B"
    """A schedule of torch.distributed.pipelining: GPipe, 1F1B (one stage per rank), Interleaved1F1B,
    InterleavedZeroBubble (several stages per rank, looped), ZBVZeroBubble (two per rank, in a V). The
    zero-bubble ones split each backward into an input and a weight pass: FSDP keeps every unit gathered
    through each run of the schedule (reshard_after_forward_mode default means never for them)."""
    pipeline_parallel_microbatch_size: int = 1
    """Rows of each pipeline micro-batch; it must divide training.local_batch_size (the number of micro-batches
    is local_batch_size / this, at least the degree for all but GPipe)."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Layers per stage (the embedding and the output counted as first/last_stage_less_layers): sets the stages
    per rank of looped schedules; unset: one per rank (GPipe, 1F1B), two (the others)."""
    pipeline_parallel_first_stage_less_layers: int = 1
    """Blocks fewer on the first stage, which also embeds the tokens."""
    pipeline_parallel_last_stage_less_layers: int = 1
    """Blocks fewer on the last stage, which also runs the final norm, the output projection and the loss."""
    reshard_after_forward_mode: int | str = "default"
    """default (reshard all units but the last), always, never, an integer N: reshard to groups of N ranks
    (e.g. within a node), or auto: per unit whether to reshard, and per block how much more to recompute
    than activation_checkpoint says, at the least modelled step time whose estimated peak fits
    parallelism.memory_budget_gib."""
    memory_budget_gib: float | None = None
    """Per-rank memory budget (GiB of tensors, as python -m torchtitan_lite.memory counts them) for
    reshard_after_forward_mode = auto; unset: 90% of the CUDA device's memory (required without one)."""
    cpu_offload: Literal["none", "all", "auto"] = "none"
    """Where sharded parameters, their gradients and optimizer state live (FSDP2 CPUOffloadPolicy, per unit):
    none (the device), all (the host; the same as training.enable_cpu_offload = true), or auto (with
    reshard_after_forward_mode = auto: per unit, offloaded only where resharding and recomputing cost more
    step time per byte freed, by one cost model; the budget is then the device's, offloaded state
    excluded)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward instead of keeping them: none; full (keep only each block's input,
    recompute the block: least memory, about a third more compute); selective (see selective_ac_option)."""
    selective_ac_option: int | str = "op"
    """With mode = selective: op (keep the outputs of matmuls and attention, recompute norms, RoPE and
    activations: most of the memory saving of full at a few percent of compute) or an integer N (full
    recomputation of every N-th block)."""
    offload: bool = False
    """Keep what checkpointed blocks hold between forward and backward (each block's input) in host memory:
    copied out as the forward saves it (on CUDA on a side stream, into pinned memory) and back one block ahead
    in backward; the values are bit for bit the same. Needs mode full or selective; device memory then holds
    about one block's working set whatever the depth (docs/long-context.md)."""
    mlp_tiles: int = 1
    """Compute each dense feed-forward over N tiles of the sequence, each recomputed in backward, so that its
    wide intermediate exists for one tile at a time (exact up to float rounding); 1: off; 0: chosen from the
    sequence (ceil(local sequence / model dim) tiles, ALST's rule). Mixture-of-experts layers are not tiled."""


@dataclass
class Compile:
    enable: bool = False
    """Compile with torch.compile (inductor): each block on its own (fullgraph) and the loss."""
    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """What compile.enable compiles: model (its blocks), loss, or both."""
    backend: str = "inductor"
    """torch.compile backend: inductor (generates fused kernels: C++ on CPU, Triton on GPU), or another
    registered backend such as aot_eager (traces without code generation: for debugging)."""


@dataclass
class Float8:
    enable_fsdp_float8_all_gather: bool = False
    """With model.converters = ["float8"]: FSDP all-gathers the blocks' weights in float8 (half the bytes of
    bf16; tensorwise scaling only). Used when the weights are sharded over more than one rank."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With enable_fsdp_float8_all_gather: compute the weights' float8 scales for the next all-gather in one
    reduction after each optimizer step."""
    force_recompute_fp8_weight_in_bwd: bool = False
    """Cast the weights to float8 again in backward instead of saving the float8 copies (less memory with FSDP)."""
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    """torchao's scaling recipe; unset or tensorwise: tensorwise with the options above. rowwise scales each
    row (more accurate, slower; not with the float8 all-gather)."""
    filter_fqns: list[str] = field(default_factory=list)
    """Linears of the blocks to keep in high precision: those whose name contains one of these (e.g.
    attention.wq); "auto_filter_small_kn" also keeps those too small for float8 to pay off (torchao's rule
    for the recipe). The output and embedding layers, and linears with a dimension not a multiple of 16,
    are never converted."""
    emulate: bool = False
    """Compute the float8 matmuls in high precision on float8-rounded values, on any device (CPU included):
    for tests, not speed."""


@dataclass
class Lora:
    enable: bool = False
    """Fine-tune low-rank adapters instead of the weights: the base weights are frozen (no gradients, no
    optimizer state, never saved); y = W x + (alpha / rank) · B A dropout(x) on each target linear."""
    rank: int = 16
    """Rank r of each adapter (A: r × in, B: out × r)."""
    alpha: float = 32.0
    """Scale numerator: the adapters' output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    target_modules: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                 "experts"]] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """The linears that get adapters, by PEFT's (Hugging Face's) names; "experts": a mixture of experts'
    routed experts (their stacked weights, as PEFT's target_parameters; lora.dropout must be 0)."""
    merge_on_export: bool = False
    """With checkpoint.last_save_in_hf: write the base with the adapters merged in (a Hugging Face model
    folder) instead of a PEFT adapter folder."""
    quantize_base: Literal["none", "nf4"] = "none"
    """nf4 (QLoRA): the frozen linears of the blocks stored as 4-bit NormalFloat (torchao's NF4, blocks of 64
    with double-quantized scales), computed in training.mixed_precision_param; embeddings, norms and the
    output layer as configured (docs/fine-tuning.md)."""


@dataclass
class DPO:
    """``[dpo]``: preference tuning (direct preference optimization) on training.dataset = "preference",
    with TRL's definitions (docs/fine-tuning.md)."""

    beta: float = 0.1
    """Strength of the pull toward the reference (β): the implicit reward of an answer is β × (its
    log-probability under the policy − under the reference)."""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid: −log σ(β Δ) (the DPO paper's); ipo: (Δ − 1/(2β))² with log-probabilities averaged over each
    answer's tokens; hinge: max(0, 1 − β Δ); Δ is the chosen answer's log-ratio minus the rejected one's."""
    label_smoothing: float = 0.0
    """Conservative DPO (sigmoid only): the chance ε that a pair's preference label is flipped; the loss is
    −(1 − ε) log σ(β Δ) − ε log σ(−β Δ). 0: plain DPO."""
    reference: Literal["auto", "adapters_off", "copy"] = "auto"
    """The reference model: adapters_off (with LoRA: the same model with its adapters switched off, no second
    copy of the weights), copy (a frozen copy of the starting weights, sharded like the policy, no gradients
    or optimizer state), auto (adapters_off with LoRA, else copy)."""
    truncation: Literal["keep_start", "keep_end"] = "keep_start"
    """A pair longer than seq_len + 1 tokens keeps its start (the end of the answer is cut; a pair whose prompt
    alone fills the window is dropped) or its end (TRL's truncation_mode); counted and logged."""
    packing: bool = False
    """Pack whole pairs into the rows of seq_len tokens, as many as fit (in training.packing's order): a pair's
    chosen sequence, then its rejected one, each attending to itself only (needs model.attention_mask =
    "block_causal"), a pair longer than a row cut to it (the longer sequence first, neither below half). The
    batch sizes then count rows, and the loss is the mean over the pairs they hold. false: each pair in two
    rows of its own, padded to seq_len (TRL's)."""


@dataclass
class GRPO:
    """``[grpo]``: online reinforcement learning with group-relative advantages on training.dataset =
    "prompts" (TRL's GRPOTrainer definitions and names; docs/rl.md). A step's global batch
    (training.global_batch_size) counts completions: global_batch_size / num_generations prompts, each
    answered num_generations times; training.local_batch_size completions per micro-batch."""

    num_generations: int = 8
    """Completions per prompt (the group whose rewards give each completion's advantage)."""
    max_completion_length: int = 256
    """Tokens a completion may have; one cut there is truncated (finish reason "length")."""
    temperature: float = 1.0
    """Sampling temperature; the training log-probabilities are of the logits divided by it too, as TRL's
    are. 0: greedy (log-probabilities then at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1: off."""
    top_k: int = 0
    """Sample among the top_k most likely tokens; 0: off."""
    stop_strings: list[str] = field(default_factory=list)
    """Text that ends a completion (kept in it), besides the tokenizer's EOS."""
    generation_batch_size: int = 0
    """Completions a rank generates in one batch (its KV cache holds this many rows of the prompt plus
    max_completion_length tokens); 0: all of a step's at once (global_batch_size / data-parallel ranks)."""
    reward_functions: list[str] = field(default_factory=list)
    """Reward functions by name: shipped ones (accuracy, format, length_penalty; docs/rl.md) or a dotted path
    to your own (module.function, importable on every rank), TRL's signature: f(prompts, completions,
    **columns) -> one float or None per completion."""
    reward_weights: list[float] = field(default_factory=list)
    """A weight per reward function (empty: 1 each); a completion's reward is the weighted sum."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage = reward − its group's mean, divided by the group's standard deviation (group), the global
    batch's (batch), or not divided (none: Dr. GRPO's)."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo"] = "dapo"
    """How the per-token losses are averaged: grpo (each completion's token mean, then the mean over
    completions), bnpo and dapo (the mean over every completion token of the global batch), dr_grpo (the sum
    over the batch / (completions × max_completion_length)); cispo: the clipped importance weight (at most
    epsilon_high, no gradient) × advantage × log-probability, averaged as dapo."""
    epsilon: float = 0.2
    """Lower clip of the importance ratio: 1 − epsilon."""
    epsilon_high: float | None = None
    """Upper clip: 1 + epsilon_high (DAPO's clip-higher; unset: epsilon); for cispo the ratio's cap itself."""
    beta: float = 0.0
    """Weight of the KL penalty to the reference model (the k3 estimator per token); 0: no reference."""
    kl_bias_correction: bool = True
    """Weigh each token's KL estimate by its importance ratio (with gradient), so that its gradient is the
    unbiased one of the reverse KL divergence (DeepSeek-V3.2; TRL's use_bias_correction_kl); it changes
    only later steps on one batch of rollouts (num_iterations > 1)."""
    reference: Literal["auto", "adapters_off", "copy"] = "auto"
    """The reference model with beta > 0, as in [dpo]: adapters_off (LoRA: the adapters switched off),
    copy (a frozen sharded copy of the starting weights), auto (adapters_off with LoRA, else copy)."""
    num_iterations: int = 1
    """Optimizer steps on each batch of rollouts (μ); above 1 the later ones weigh each token by its
    importance ratio to the policy that sampled it."""
    mask_truncated_completions: bool = False
    """Leave truncated completions (no EOS or stop string within max_completion_length) out of the loss."""
    importance_sampling: Literal["none", "token_truncate", "token_mask", "sequence_truncate",
                                 "sequence_mask"] = "sequence_mask"
    """Given rollouts with their sampling log-probabilities (another engine's): weigh each token's policy loss
    by the ratio of the trainer's probability to the sampler's (TRL's vLLM correction), per token or per
    completion (the product over its tokens), truncated at importance_sampling_max or, for the mask modes,
    zero where above it; none: no correction. Rollouts without log-probabilities are not weighed."""
    importance_sampling_max: float = 3.0
    """The ratio's cap (truncate) or the largest ratio kept (mask)."""
    rollouts_path: str | None = None
    """Train on rollouts made elsewhere instead of generating: JSON lines, one prompt group a row (prompt or
    prompt_ids, completions or completion_ids, rewards, optionally logprobs; docs/rl.md)."""


@dataclass
class MoEConfig:
    """``[moe]``: the mixture-of-experts router and its balancing."""

    aux_loss_coef: float | None = None
    """Weight of the load-balancing auxiliary loss in the training loss (transformers' router_aux_loss_coef,
    computed as its load_balancing_loss_func over every MoE layer's tokens of the global batch); unset: the
    model's (its config.json's router_aux_loss_coef, 0.001 for Qwen3-MoE, 0 for DeepSeek-V3); 0: off.
    Mixture-of-experts models only."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (the mean squared log-sum-exp of the router logits, summed over the MoE
    layers); 0: off."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each optimizer step every expert's router bias moves
    by this much toward balance (up for experts that got fewer tokens than the mean, down for those that
    got more); needs a sigmoid router; 0: off. The bias is saved in checkpoints and exported."""
    top_k: int = 0
    """Experts per token; 0: the model's."""
    score_func: Literal["softmax", "sigmoid"] | None = None
    """The router's scores: softmax (Qwen3-MoE) or sigmoid with a per-expert bias (DeepSeek-V3); unset: the model's."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps (and at the first and last step)."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files (rank 0)."""
    save_tb_folder: str = "tb"
    """TensorBoard folder inside job.dump_folder; each run writes its own timestamped subfolder."""
    disable_color_printing: bool = False
    """Never colour the console lines (they are coloured only on a terminal, and never when NO_COLOR is set)."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device for MFU; unset: from the table of known GPUs (on CPU and unknown
    devices MFU is not reported)."""
    enable_wandb: bool = False
    """Log every metrics record (as metrics.jsonl has it) to Weights & Biases (rank 0; needs the wandb
    package: pip install 'torchtitan_lite[wandb]'). W&B's own environment applies: WANDB_MODE=offline
    writes the run under job.dump_folder/wandb only, for wandb sync later."""
    wandb_project: str = "torchtitan_lite"
    """W&B project of the run."""
    wandb_run_name: str | None = None
    """W&B name of the run; unset: job.description."""


@dataclass
class Validation:
    enable: bool = False
    """Compute a validation loss (no gradients, over all ranks) every validation.freq steps and at the last step."""
    dataset: str = "python_stdlib_validation"
    """Validation dataset; same names as training.dataset (parquet/arrow: only the rows needed for
    validation.steps are read). The default is held out from python_stdlib."""
    dataset_path: str | None = None
    """File or folder read by the text, tokens, parquet and arrow datasets."""
    datasets: list[DataSource] = field(default_factory=list)
    """Several validation sets instead of validation.dataset: [[validation.datasets]] tables with name,
    dataset and dataset_path; each is evaluated on its own (validation/NAME/loss,
    validation/NAME/perplexity)."""
    freq: int = 100
    """Run validation every this many training steps."""
    steps: int = 20
    """Batches per validation run, each validation.global_batch_size windows, read in order from the start of
    the set; -1: the whole validation set."""
    global_batch_size: int = -1
    """Windows per validation batch over all ranks; -1: local_batch_size × data-parallel degree. Set it to get
    the same validation windows, and so comparable losses, on any world size."""
    local_batch_size: int = -1
    """Windows per rank per forward pass; -1: training.local_batch_size."""
    seq_len: int = -1
    """Tokens per validation window; -1: training.seq_len."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces, one file per rank, for a window of steps every profile_freq steps."""
    save_traces_folder: str = "profile_traces"
    """Trace folder inside job.dump_folder; each window writes iteration_<step>/rank<r>_trace.json."""
    profile_freq: int = 10
    """Steps between trace windows; a trace ends at every multiple of it."""
    profiler_warmup: int = 3
    """Steps the profiler runs untraced before each recorded window."""
    profiler_active: int = 1
    """Steps recorded per window."""
    enable_memory_snapshot: bool = False
    """CUDA only: record allocator history and dump a memory snapshot every profile_freq steps (and on
    out-of-memory)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder inside job.dump_folder."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints with torch.distributed.checkpoint and resume from the latest one in checkpoint.folder
    at start."""
    folder: str = "checkpoint"
    """Checkpoint folder inside job.dump_folder; each checkpoint is a step-<N> subfolder."""
    interval: int = 500
    """Save every this many steps, and at the last step."""
    max_failed_saves: int = 3
    """Saves that may fail in a row (a full disk, an I/O error) while training goes on: each is one log line,
    its partial folder removed and the committed checkpoints kept, and the next interval saves again; the
    one that makes this many stops the job (exit 4). 1 stops at the first. The seed, the last step's save
    and a save on a signal always stop it."""
    keep_latest_k: int = 0
    """Keep only the newest k committed checkpoints (older ones are deleted after a new one is committed); 0
    keeps all."""
    load_step: int = -1
    """Step to resume from; -1: the latest committed checkpoint (none: start from scratch)."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of a checkpoint not to restore: model, optimizer, lr_scheduler, dataloader, train_state."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """disabled: training waits for each save; async: training waits only while the state is copied to CPU
    memory, the write runs in the background (over a gloo group) and the next save or the end of the run
    waits for it."""
    last_save_model_only: bool = False
    """The save at the last step holds only the model weights (in export_dtype): for export, not for
    continuing training."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the weights in a model-only last save (last_save_model_only / last_save_in_hf)."""
    last_save_in_hf: bool = False
    """Write the last save as a Hugging Face safetensors folder of the model's family (+ config.json); needs
    last_save_model_only."""
    initial_load_path: str | None = None
    """Checkpoint to start from when checkpoint.folder holds none: a step-<N> folder (DCP), or a Hugging Face
    safetensors folder with initial_load_in_hf."""
    initial_load_model_only: bool = True
    """Take only the model weights from initial_load_path (the run starts at step 0); false also restores
    optimizer, schedule, data position and step."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face safetensors folder of the model's family (names and row layouts
    mapped by the family's adapter, e.g. Llama's q/k RoPE permutation)."""
    create_seed_checkpoint: bool = False
    """Write the initialised weights as step-0 in checkpoint.folder on one process and exit; runs at any world
    size can start from it."""
    save_on_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGINT"]] = field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"]
    )
    """Signals (preemption: Slurm, Kubernetes, spot instances send SIGTERM before SIGKILL) on which every rank
    finishes its step, one checkpoint is saved synchronously (an async save in flight completes first) and
    the job exits with code 75 (requeue); a second signal during the save is ignored. [] keeps the default
    actions. Without checkpoint.enable the job still stops after the step, with nothing saved."""
    on_corrupt: Literal["fallback", "stop"] = "fallback"
    """A checkpoint to resume that fails verification (a data file missing, short, or whose checksum differs;
    unreadable metadata): fallback resumes from the newest earlier one that verifies (the damaged ones are
    renamed step-<N>.corrupt, not deleted); stop ends the job (exit 4). With none that verifies the job
    stops (exit 4), never starts afresh."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout of collectives until the first training step has finished: process-group creation, model and
    checkpoint loading (a slow filesystem or a first compilation needs room)."""
    train_timeout_seconds: int = 100
    """Timeout of every collective from the end of the first step on: when a rank dies or hangs, the others
    fail with an error within it instead of hanging."""


@dataclass
class Debug:
    seed: int = 42
    """Seed for weights and data order; with a fixed training.global_batch_size the same seed gives the same
    run on any world size."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower; bit-reproducible runs)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    lora: Lora = field(default_factory=Lora)
    dpo: DPO = field(default_factory=DPO)
    grpo: GRPO = field(default_factory=GRPO)
    moe: MoEConfig = field(default_factory=MoEConfig)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


LOADABLE_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
"""Parts of a checkpoint ``checkpoint.exclude_from_loading`` may name."""
