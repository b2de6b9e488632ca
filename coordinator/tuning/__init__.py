"""Running jobs to choose settings: the autotuner (``zeroplane tune``), the pool of
workers its trials run in, and the hyperparameter search (``zeroplane hpo``)."""
