"""A dense reward for `detinfer rl` on random-weight models (`--reward-funcs rl_dense_reward:even_ids`, with
bench/ on PYTHONPATH): the fraction of a completion's token ids that are even. A random model scores ~0.5
with a spread inside each group, so GRPO's advantages and the update are nonzero and the weights move every
step (a task's own reward is 0 for such a model, which leaves the weights where they were)."""


def even_ids(completion_ids, **_):
    return [sum(1 for i in ids if i % 2 == 0) / len(ids) if ids else 0.0 for ids in completion_ids]
