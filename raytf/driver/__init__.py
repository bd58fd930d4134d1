"""The driver's side of a job: it places, starts, supervises and reports, and imports no TensorFlow.

    controller   the job as a state machine, stepped over the interfaces in group
    policy       its decisions (restarts, elastic sizes, replacements, hangs) and every number it uses
    group        the WorkerGroup and Resources interfaces; ray_group implements them on Ray
    placement    placement groups: reserve, release, the shortage message
    failure      what went wrong, root cause first
    packaging    the job folder as a package for the cluster
    session      which Ray to use; quiet: the driver's stderr; report: progress, summary, result.json
"""
