"""Inside the Ray actors: the TaskActor (task_actor), what a loop sees of its task (context), the one
training loop (loop) and each strategy's half of it (mirrored, parameter_server), with the step pieces
they share (steps). TensorFlow is imported here, after TF_CONFIG is set."""
