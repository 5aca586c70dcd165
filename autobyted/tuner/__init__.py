"""The tuner: per job, predict, decide and re-tune the scheduler's (partition, credit) configuration.

Files, one concern each:
    features.py   what the predictor sees (below) and how a window of steps becomes a context
    predictor.py  the xgboost bootstrap ensemble, its training pairs, online retraining, file format
    search.py     JobTuner: one job's search, thin: keeps the clock, dispatches every sample to
                  the phase in effect and hands what it asks for to transitions.py
    job.py        what a job's search keeps between phases: TunerJob (by who writes it: the
                  clock, the noise, the status, what the search remembers) and Search (one
                  search's trials and verdicts)
    phases/       one module per phase, each owning its own state, measuring and judging, and
                  returning what it asks for: baseline.py (warm-up, baseline, re-tuning),
                  exploring.py (a trial), checking.py (checking, confirming), verifying.py (the
                  winner after the switch), watching.py (holding, watching), paused.py;
                  phases/__init__.py is the map. They import none of one another.
    actions.py    what a phase asks for (Open, Accept, Check, Finish, RollBack, Abort, ...)
    transitions.py the graph: acts on an action; the only place that issues decisions (a refused
                  one pauses the job), names the status (STATES) and builds the next phase; which
                  trial is next and how a search ends
    verdict.py    the stateless decision arithmetic: what beats what, a trial's value and which
                  trials pay, the gain calibration, the A-B-A and context-jump tests
    evidence.py   what earlier jobs of the shape measured and held (and of the model at other
                  rank counts held), and the predictor's measured errors on this job: both
                  correct the candidates' scores
    measured.py   the records a search keeps: a measured window, a decision awaiting its apply
    sink.py       where a search's effects go: the daemon's storage and control path (manager.py),
                  or memory (memory_sink.py, for the simulator and tests)
    drift.py      CUSUM drift detection on the held configuration's steps
    manager.py    the daemon's side: reads samples from storage, runs every job's search on one
                  worker thread, retrains the predictor on another, writes decisions and state
    prior.model   the simulator-trained prior (simulator/train_prior.py regenerates it)
    sharded.py    ShardTuner: an FSDP2 job's search over FSDP2's knobs (prefetch depths,
                  resharding), measured, without the predictor; the manager runs it in place
                  of JobTuner for jobs whose engine is fsdp2
    eligible.py   which jobs are tuned at all

The prediction target
---------------------
Not a step time, but log(step time under a candidate / step time under the reference), where the
reference is the configuration the job ran while its context was measured. Context figures such as
exposed communication, the bandwidth estimate and queueing delay depend on the configuration they
were measured under; predicting a ratio *from* a stated reference keeps that dependence explicit
(the reference is an input) and cancels what the model cannot know (this machine's absolute speed).
The predicted step time of a candidate is the reference's measured median x exp(prediction); the
reference itself is never predicted (it was measured).

Features (features.FEATURE_NAMES), with why each is there
-------------------------------------------------------
Context, medians over a window of rank 0's steps of the reference configuration:
    log_step_s            absolute step length: per-message costs matter more in short steps
    log_compute_s         forward + backward time (excludes waiting): the work overlap can hide
    backward_share        gradients appear during the backward: how much time partitions have
    compute_share         compute / step: how communication-bound the job is under the reference
    exposed_share         forward time spent waiting for parameters / step: what is left to hide
    queueing_share        mean wait of a partition for credit / step: is the credit window binding
    log_gradient_bytes    bytes all-reduced per step
    log2_world_size,      a ring all-reduce moves 2(N-1)/N of the bytes and pays 2(N-1) latencies
      ring_factor
    backend_nccl/gloo     per-collective cost differs by an order of magnitude between backends
    log_tensor_count,     the model fingerprint: how the gradient splits into tensors decides how
      largest_tensor_share, many messages "no partitioning" sends and how slices fuse
      log_median_tensor_bytes
    log_bandwidth         the scheduler's own estimate (bytes / time from first issue to last
                          completion); measured under the reference, hence the reference features
    log_wire_s,           ring bytes / bandwidth, and its ratio to compute: the balance that decides
      log_wire_to_compute whether overlap, partitions or credit can pay at all
    host_load             others' share of the host CPU (autobyte.hostload); NaN when unknown
                          (xgboost's missing value), so old clients and the simulator cost nothing
Configuration, once for the reference (ref_*) and once for the candidate (cand_*):
    partition_none, log2_partition, log2_partition_share (of the gradient)
    credit_unlimited, log2_credit, log2_credit_share, log2_credit_in_partitions
    tail_none, log2_tail_share (of the gradient), log2_tail_in_credits: the tail window (Config.tail_bytes),
                          which holds the deep credit window back at the end of the backward
    log_messages          all-reduces per step as the scheduler cuts them (one per tensor without
                          partitioning, ceil(gradient / partition) with it)
Differences candidate - reference: delta_log_messages, delta_log2_partition, delta_log2_credit
(trees split on one feature at a time; the differences save them learning subtraction).
The per-collective cost: ref_latency_share, cand_latency_share = messages x the job's measured
small all-reduce (its registration's collective_latency_s) / the reference's step, and
delta_latency_share, their difference: the step time a switch adds or saves in latency alone,
before any overlap (at 8 gloo ranks several ms a collective, on NCCL tens of us). NaN when the job
did not measure it.

Not features, on purpose: the scenario's true bandwidth or compute factor (a rank cannot see them),
wall-clock time, job names.
"""
