"""Three GRPO steps on the training engine: generate, score, advantages, one optimizer step."""

import sys
from functools import partial

from torchtitan_lite.config import load_job_config
from torchtitan_lite.engine import TrainingEngine
from torchtitan_lite.rl.losses import aggregate, group_advantages, policy_losses
from torchtitan_lite.rl.rewards import resolve_reward_functions
from torchtitan_lite.rl.rollout import SamplingParams
from torchtitan_lite.rl.rollouts import completion_rows, generation_seed, score_completions, weighted_rewards

engine = TrainingEngine(load_job_config(sys.argv[1:]))
job, g = engine.trainer.config, engine.trainer.plan.objective.setup  # the job's [grpo], checked and resolved
tokenizer = engine.trainer.plan.tokenizer
functions = resolve_reward_functions(g.reward_functions)
stop = (tokenizer.eos_id,)
sampling = SamplingParams(max_new_tokens=g.max_completion_length, temperature=g.temperature, top_p=g.top_p,
                          top_k=g.top_k, stop_token_ids=stop, stop_strings=g.stop_strings)


def grpo_loss(part, logp, entropy, labels, *, advantages, completions, tokens):
    """Rows ``part``'s share of the step's GRPO loss, from their log-probabilities ``logp``."""
    loss, _ = policy_losses(logp, logp.detach(), advantages[part].to(logp.device), g)
    return aggregate(loss, (labels != -100).float(), g, completions=completions, tokens=tokens)


for batch in range(3):
    prompts = [row for part in engine.trainer.loader.next_batch() for row in part]  # this rank's
    asked = [row for row in prompts for _ in range(g.num_generations)]  # each prompt's group
    done = engine.generate([row.ids.tolist() for row in asked], sampling,
                           seed=generation_seed(job.debug.seed, batch, engine.dp_rank))
    completions = [c.token_ids for c in done]
    scores = score_completions(functions, prompts, completions, num_generations=g.num_generations,
                               decode=tokenizer.decode, max_completion_length=g.max_completion_length)
    rewards = weighted_rewards(scores, g.reward_weights)  # (NaN where no function scored: advantage 0)
    advantages, _ = group_advantages(rewards, g.num_generations, g.scale_rewards)  # (whole groups per rank)
    inputs, labels, _, _ = completion_rows([row.ids.tolist() for row in asked], completions,
                                           seq_len=job.training.seq_len, pad_id=stop[0], stop_ids=stop,
                                           max_completion_length=g.max_completion_length,
                                           mask_truncated=g.mask_truncated_completions)
    tokens = float(engine.sum_over_ranks((labels != -100).sum().double()))  # every rank's counted tokens
    loss_fn = partial(grpo_loss, advantages=advantages, completions=len(asked) * engine.dp_size, tokens=tokens)
    metrics = engine.train_batch(inputs, labels, loss_fn, temperature=g.logit_temperature)
    if engine.rank == 0:
        print(f"step {engine.step} loss {metrics['loss']:.9f} grad_norm {metrics['grad_norm']:.9f}", flush=True)
engine.close()
