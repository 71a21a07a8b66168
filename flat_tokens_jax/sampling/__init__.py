"""Which record each row reads: the stateless permutation, batch-size
schedules, mixtures and the samples of a step.
"""
