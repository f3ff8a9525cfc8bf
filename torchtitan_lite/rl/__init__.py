"""Online reinforcement learning: rollouts on the training layout, rewards, GRPO-family objectives."""
