"""The run around the training loop, in one object: what all four recipes do the same way and
what is not the lesson. The recipe keeps the lesson in sight (the `Accelerator(...)` call,
`prepare()`, the step, the log dict, `evaluate()`) and decides what to log, when to evaluate and
when to checkpoint; `TrainingRun` does the rest:

    with TrainingRun(accelerator, args, in_effect) as run:  # claims and locks --output_dir
        set_seed(args.seed)  # --seed unset: the one TrainingRun settled for the launch
        ...  # data, model (run.fingerprint(model)), optimizer, accelerator.prepare(...)
        run.start(model, optimizer, train_dataloader, schedule, identity=..., evaluate=...)
        if args.eval_only:
            return run.evaluate_only()
        for epoch in run.epochs():
            for batch in run.epoch_batches(train_dataloader, epoch):
                ...  # the step: forward, backward, clip, optimizer step, schedule, zero_grad
                run.count_batch(batch, loss, grad_norm)
                if not accelerator.sync_gradients:
                    continue  # inside an accumulation window
                run.count_optimizer_step()
                ...  # run.warn_nonfinite(...), run.stop_diverged() (fp16: no loss scale helps)
                ...  # run.stop_if_loss_diverged(), run.log({...})
                ...  # run.evaluate(epoch + 1), run.save_checkpoint()
                if run.preemption_requested():
                    run.checkpoint_and_exit()
                if run.step >= schedule.max_train_steps or run.early_stopped:
                    break
            run.end_epoch()
            ...  # run.evaluate(epoch + 1) unless this step had one; --checkpointing_steps epoch's save
        return run.save_final_model(tokenizer)

- the output folder: claimed and locked when the block opens (`outputs.OutputDir`);
- `start()`: the resume (`--resume_from_checkpoint`: model, optimizer, scheduler, GradScaler and
  RNG states), the step telemetry and activation monitor, the run facts, the trackers (W&B /
  TensorBoard) and the run record (`log_history.jsonl`);
- the loop's bookkeeping, each a method the recipe calls where it happens: epochs and the batches
  a resumed run skips, the micro-batch and optimizer-step counts and the progress bar, the
  skipped-step warning and the stop when no loss scale helps, evaluation and checkpoint saves, the
  best evaluation (--metric_for_best_model: its checkpoint, early stopping; BestModel, below), the
  preemption exit (SIGTERM/SIGINT: a checkpoint, then exit 143/130);
- the final save (`.final.tmp`, renamed into place; --load_best_model_at_end: the best evaluation's
  weights) and its summary, `eval_results.json` last;
- `__exit__`, the one exit path of every run (finished, evaluated only, preempted, failed): the
  progress bar, signal handlers (kept after a lost rank, until its error is printed) and hooks go,
  the trackers end (finished or preempted runs; a failed one is left to the tracker's own crash
  handling), the lock is released.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from accelerate.logging import get_logger
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from amp_recipes import errors, no_trainer
from amp_recipes.amp.compiling import CompileMonitor
from amp_recipes.amp.memory import gradient_checkpointing_on
from amp_recipes.amp.precision import log_fp8_report, log_preflight
from amp_recipes.errors import InputError, TrainingDiverged, lost_rank_message
from amp_recipes.measure.engine import peak_memory_bytes
from amp_recipes.training import checkpoint, hub, optim, outputs
from amp_recipes.training.peers import PeerWatch
from amp_recipes.training.telemetry import ActivationMonitor, StepTelemetry, ThroughputMeter

logger = get_logger(__name__)


class TrainingRun:
    """One training (or evaluation-only) run of a recipe: see the module docstring."""

    def __init__(self, accelerator, args, precision: dict):
        self.accelerator, self.args, self.precision = accelerator, args, precision
        log_preflight(precision, logger)  # AMP: the precision in effect, who chose it, warnings
        hub.hide_token(args)  # --hub_token: out of sys.argv, which trackers record
        # --push_to_hub: the repo created now (main process), so a push that cannot work stops the run here.
        self.hub_repo = hub.create_repo(args) if accelerator.is_main_process else None
        self.output = outputs.claim_output_dir(accelerator, args)  # refuses a folder that holds a run
        self.checkpoints_dir = Path(args.output_dir) / "checkpoints"
        # --seed unset (--hf_example_defaults): one for the launch, drawn, or a resumed run's; the
        # recipe seeds with it.
        no_trainer.settle_seed(accelerator, args, self.checkpoints_dir)
        self.step, self.epoch, self.batches_in_epoch, self.results = 0, 0, 0, {}
        self.progress = self.preemption = self.activations = None
        self.initial_weights = None
        self.last_checkpoint = None  # ((step, epoch, batches_in_epoch), path) of the last one written
        self.nonfinite_at = None  # the first inf/NaN module found at this step, for the stop message
        self.best = None  # --metric_for_best_model: the best evaluation so far (BestModel, below)
        self.evaluated_step = None  # the step of the last evaluation (an epoch's end does not repeat it)
        self.train_loss = (
            None  # the mean training loss of the last epoch (eval_results.json, all_results.json)
        )
        self.ended = False  # the trackers end with a finished or preempted run, not a failed one
        # Several processes: a rank that died or failed ends this one within seconds, with one
        # sentence, also where this one waits in a collective that never completes (NCCL). Started
        # last: from here __exit__ stops it, whatever ends the run.
        self.peers = PeerWatch.for_run(accelerator, args.ddp_timeout)
        if self.peers is not None:
            self.peers.start()

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.peers is not None:
            self.peers.stop()
        errors.mark_end(run_end(exc))  # the other ranks' watch must not take this exit for a death
        # The signals go back to whoever had them before training; not after a lost rank: the
        # launcher's SIGTERM to every process is on its way, and with the default handler back it
        # could end this one before one_sentence_errors prints the sentence that says what
        # happened. Kept, the handler only notes it, and the process ends with that error.
        if self.preemption is not None and lost_rank_message(exc) is None:
            self.preemption.restore()
        if self.activations is not None:
            self.activations.remove()
        if self.ended:
            self.accelerator.end_training()
        self.output.release()

    # ------------------------------------------------------------------ after prepare()
    def fingerprint(self, model) -> None:
        """Before prepare(): the sha256 of the weights as loaded (`initial_weights_sha256`); the arms
        of one seed in a paired run must start from the same weights."""
        self.initial_weights = outputs.weights_fingerprint(model)

    def start(
        self, model, optimizer, train_dataloader, schedule, identity: dict, evaluate, predict=None, facts=None
    ):
        """After prepare(): resume, then set up telemetry, trackers and the run record.
        `identity`: what a checkpoint must match to be resumed by this run (its task, labels ...),
        also reported as run facts; `evaluate`: a function returning the `eval_*` scores of every
        eval split; `predict`: a function writing --do_predict's prediction files, returning their
        `predict_*` counts; `facts`: more run facts of the recipe's own."""
        accelerator, args = self.accelerator, self.args
        log_fp8_report(self.precision, logger)  # AMP: the Linear layers prepare() made fp8, if any
        self.model, self.schedule, self.evaluate_scores, self.predict = model, schedule, evaluate, predict
        self.plain_model = accelerator.unwrap_model(model, keep_torch_compile=False)  # no DDP/compile wrapper
        model_type, model_shape, attention = describe_model(self.plain_model)
        self.identity = {**identity, "model": model_shape, "seed": args.seed}
        # A folder a transformers example wrote has no record of its position: `layout` places it.
        layout = (schedule.steps_per_epoch, len(train_dataloader), accelerator.gradient_accumulation_steps)
        resumed = checkpoint.resume(
            accelerator, args.resume_from_checkpoint, self.checkpoints_dir, self.identity, layout
        )
        self.resumed, self.step = resumed, resumed["global_step"]
        # The last evaluation's scores and step: a resumed run that evaluates no more reports them.
        self.results, self.evaluated_step = resumed.get("results") or {}, resumed.get("evaluated_step")
        if args.metric_for_best_model:  # a resumed run compares against its checkpoint's best
            self.start_best(resumed.get("best"))
        # AMP: loss scale, skipped steps, grad norm, non-finite checks; created after a resume has
        # restored the GradScaler, so it starts from the checkpoint's loss scale.
        self.telemetry = StepTelemetry(
            accelerator, model, args.max_consecutive_skipped_steps, args.diagnose_overflow
        )
        self.telemetry.load_state_dict(resumed.get("telemetry", {}))
        # AMP: each module's max |activation| / 65504; off under --torch_compile (its hooks would recompile).
        monitor_interval = 0 if args.torch_compile else args.activation_monitor_interval
        self.activations = ActivationMonitor(self.plain_model, monitor_interval)
        self.compiled = CompileMonitor(args.torch_compile)  # graphs compiled; whether dynamo gave up
        self.facts = {  # for the trackers' config and eval_results.json
            **self.precision,
            **identity,
            **(facts or {}),
            "model_type": model_type,
            "distributed_type": accelerator.distributed_type.value,
            "total_train_batch_size": train_dataloader.total_batch_size * args.gradient_accumulation_steps,
            "attn_implementation": attention,  # SDPA: fused
            "gradient_checkpointing": gradient_checkpointing_on(self.plain_model),  # as the model says
            "optimizer": optim.describe_optimizer(optimizer),  # read inside DeepSpeed's wrappers too
            "initial_weights_sha256": self.initial_weights,
        }
        run_config = hub.redacted({**vars(args), **self.facts, **schedule._asdict()})  # no Hub token
        self.output.clear_previous_run(accelerator)  # --overwrite_output_dir: the old run's checkpoints go
        outputs.init_trackers(accelerator, args, run_config, resumed["tracker_run_id"])  # W&B / TensorBoard
        self.record = outputs.RunRecord(args.output_dir, accelerator.is_main_process, self.step or None)
        self.record.write_config(run_config)  # run_config.json: every setting, as the trackers have them
        logger.info(describe_run(args, self.precision, self.facts, schedule, self.step))
        self.meter = ThroughputMeter(accelerator.device)  # samples/s, tokens/s, padding
        self.epoch_loss = torch.zeros(2, device=accelerator.device)  # this epoch's finite losses: sum, count

    def evaluate(self, epoch) -> dict:
        """Every eval split, logged; its time stays out of the throughput. With
        --metric_for_best_model, compared with the best evaluation so far."""
        with self.meter.paused():
            scores = self.evaluate_scores()
        self.results = {"epoch": epoch, **scores}
        logger.info(f"step {self.step}: {self.results}")
        self._record(self.results)
        self.evaluated_step = self.step
        if self.best is not None and not self.args.eval_only:
            self._track_best()
        return self.results

    def start_best(self, state: dict | None) -> None:
        """The best evaluation so far: a fresh one, or the resumed checkpoint's (unless it ranked by
        another metric, or its best checkpoint is gone: then a fresh one, said in a warning)."""
        self.best = BestModel(self.args, state)
        if self.best.restarted:
            logger.warning(
                f"The checkpoint's best evaluation was ranked otherwise: a new best by {self.best.key}."
            )
        path = self._best_checkpoint()
        if self.args.load_best_model_at_end and path is not None and not path.is_dir():
            logger.warning(
                f"The best evaluation's checkpoint {path} is gone: a new best from this run's evaluations."
            )
            self.best = BestModel(self.args)

    def _best_checkpoint(self) -> Path | None:
        """The best evaluation's checkpoint: in this run's checkpoints, or beside the checkpoint it
        resumed from (another output folder's); None when none was saved."""
        if self.best is None or not self.best.checkpoint:
            return None
        path = self.checkpoints_dir / self.best.checkpoint
        if not path.is_dir() and "path" in self.resumed:
            path = Path(self.resumed["path"]).parent / self.best.checkpoint
        return path

    def _track_best(self) -> None:
        """Is this evaluation the best so far? With --load_best_model_at_end its checkpoint is saved
        (kept through rotation); after --early_stopping_patience evaluations without one, the run stops."""
        best = self.best
        if best.update(self.results, self.step):
            logger.info(f"step {self.step}: the best {best.key} so far, {best.value}")
            if self.args.load_best_model_at_end:
                best.checkpoint = f"{checkpoint.PREFIX}{self.step}"  # named first: its own record says so
                self.save_checkpoint()
        elif best.stop:
            logger.warning(
                f"Early stopping after step {self.step}: {best.patience} evaluations without a better "
                f"{best.key} than {best.value} (step {best.step})."
            )

    @property
    def early_stopped(self) -> bool:
        """--early_stopping_patience evaluations in a row brought no better --metric_for_best_model."""
        return self.best is not None and self.best.stop

    def evaluate_only(self) -> dict:
        """--eval_only: evaluate the model (or the resumed checkpoint), write the results, stop."""
        results = {**self.evaluate(self.resumed["log_epoch"]), **self.facts, **self.compiled.report()}
        results.update(self._predictions())  # --do_predict: the test examples' predictions, written
        self._write_all_results(results)
        self.record.write_results({**results, "model_name_or_path": self.args.model_name_or_path})
        outputs.write_final_figures(self.accelerator, results, self.step)  # W&B run summary, TensorBoard
        self.ended = True
        return results

    # ------------------------------------------------------------------ the loop
    def epochs(self):
        """The epochs left to train (a resumed run starts in its checkpoint's)."""
        # SIGTERM/SIGINT: noted, and acted on at the end of a step (preemption_requested).
        self.preemption = checkpoint.PreemptionHandler()
        self.progress = tqdm(
            total=self.schedule.max_train_steps,
            initial=self.step,
            disable=not self.accelerator.is_local_main_process,
        )
        for epoch in range(self.resumed["epoch"], self.schedule.num_epochs):
            if self.early_stopped:  # also a resumed run whose checkpoint had stopped early
                return
            self.epoch = epoch
            yield epoch

    def epoch_batches(self, train_dataloader, epoch):
        """The epoch's batches, shuffled by (seed, epoch) only; in a resumed run's first epoch,
        without the batches its checkpoint had seen (none, resumed from the last step)."""
        train_dataloader.set_epoch(epoch)
        skip = self.resumed["batches_in_epoch"] if epoch == self.resumed["epoch"] else 0
        self.batches_in_epoch = skip  # the position a checkpoint records
        if self.step >= self.schedule.max_train_steps:  # resumed from the run's last step
            return []  # nothing left to train; the epoch still ends (evaluation, final save)
        return self.accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader

    def count_batch(self, batch, loss, grad_norm) -> None:
        """One more micro-batch of the epoch; its loss, gradient norm (None inside an accumulation
        window), samples and tokens go into the next log line. Stays on the device: no
        synchronisation per step."""
        self.batches_in_epoch += 1
        self.telemetry.observe(loss, grad_norm)
        self.meter.update(batch)
        finite = torch.isfinite(loss.detach()).float()
        self.epoch_loss += torch.stack([loss.detach().float().nan_to_num() * finite, finite])

    def count_optimizer_step(self) -> None:
        """One more optimizer step (`run.step`), and the progress bar moves."""
        self.step += 1
        self.progress.update(1)
        self.nonfinite_at = None  # warn_nonfinite finds this step's, if asked

    def warn_nonfinite(self, batch, overflow: bool) -> None:
        """AMP: a warning naming the first module whose output or gradient was inf/NaN at this step:
        after a skipped fp16 step (found by replaying the batch), or every step under
        --diagnose_overflow (nothing is said of a step that stayed finite)."""
        self.nonfinite_at = self.telemetry.first_nonfinite(batch)
        if overflow or self.nonfinite_at:
            logger.warning(self.telemetry.nonfinite_message(self.step, overflow, self.nonfinite_at))

    def stop_diverged(self) -> None:
        """AMP: fp16 skipped --max_consecutive_skipped_steps steps in a row, so no loss scale helps:
        a checkpoint (with --checkpointing_steps; the weights are still those of the last good
        step), then TrainingDiverged, which the recipe prints as one sentence."""
        if self.args.checkpointing_steps:
            self.save_checkpoint()
        raise TrainingDiverged(self.telemetry.stop_message(self.step, self.nonfinite_at))

    def _record(self, values: dict) -> None:
        """Values of this step into the trackers and log_history.jsonl."""
        self.accelerator.log(values, step=self.step)
        self.record.log(values, self.step)

    def stop_if_loss_diverged(self) -> None:
        """AMP: bf16/fp32: TrainingDiverged if a loss since the last check was not finite (the update
        has spoiled the weights; fp16 skips such steps). At logging steps and before every save, on
        every process at the same steps (the check is a collective)."""
        self.telemetry.check_finite(self.step, self.precision["precision_in_effect"])

    def activation_ranges(self) -> dict:
        """AMP: `fp16_range/<module>`: max |activation| / 65504 of the modules closest to overflowing."""
        return {f"fp16_range/{name}": ratio for name, ratio in self.activations.read().items()}

    def log(self, logs: dict) -> None:
        """A log line: the trackers, log_history.jsonl, the progress bar."""
        self.progress.set_postfix({k: logs[k] for k in ("loss", "loss_scale", "skipped_steps") if k in logs})
        self._record(logs)

    def save_checkpoint(self, example_name: str | None = None) -> Path:
        """checkpoint-<step>, written aside and renamed when complete, at the loop's position; not
        again when this very position was just written (a best evaluation's checkpoint, then
        --checkpointing_steps'; a preemption right after either): writing it again would cost time,
        the launcher's grace time after a SIGTERM, and replace a complete checkpoint.
        `example_name` (--checkpointing_steps: epoch_<i>, step_<n>): the same checkpoint also under
        the name transformers' no_trainer examples give it, <output_dir>/<example_name>."""
        self.stop_if_loss_diverged()  # AMP: never saves inf/NaN
        epoch, batches_in_epoch = self.epoch, self.batches_in_epoch
        if self.last_checkpoint and self.last_checkpoint[0] == (self.step, epoch, batches_in_epoch):
            path = self.last_checkpoint[1]
        else:
            path = self._write_checkpoint(epoch, batches_in_epoch)
        if example_name:
            checkpoint.save_example_folder(self.accelerator, path, example_name)
        return path

    def _write_checkpoint(self, epoch: int, batches_in_epoch: int) -> Path:
        position = {
            **self.identity,
            "epoch": epoch,
            "batches_in_epoch": batches_in_epoch,
            "telemetry": self.telemetry.state_dict(),  # AMP: skipped-step counts (the GradScaler's own)
            "best": self.best.state_dict() if self.best else None,  # --metric_for_best_model, patience
            "results": self.results,  # the last evaluation's scores
            "evaluated_step": self.evaluated_step,
        }
        path = checkpoint.save_checkpoint(
            self.accelerator,
            self.checkpoints_dir,
            self.step,
            position,
            self.args.save_total_limit,
            keep=self.best.checkpoint if self.best else None,  # --load_best_model_at_end's
        )
        self.last_checkpoint = ((self.step, epoch, batches_in_epoch), path)
        return path

    def preemption_requested(self) -> bool:
        """Whether a SIGTERM/SIGINT arrived (a scheduler's preemption notice, Ctrl-C). With several
        processes the ranks agree on it every 10 steps, so that all of them stop at one step."""
        return self.preemption.should_stop(self.accelerator, self.step)

    def checkpoint_and_exit(self) -> None:
        """After a SIGTERM/SIGINT: a checkpoint of this step, then exit 143 (SIGTERM) or 130 (SIGINT).
        With several processes the stop comes at a multiple of 10 steps, often a --checkpointing_steps
        one: save_checkpoint then returns the checkpoint it just wrote."""
        path = self.save_checkpoint()
        logger.warning(self.preemption.stop_message(self.step, path))
        self.ended = True
        raise SystemExit(self.preemption.exit_code)

    def end_epoch(self) -> None:
        """The epoch's padding share (logged) and mean training loss (for eval_results.json). From
        here the position is the next epoch's start, so a checkpoint saved now (the epoch's, a best
        evaluation's) resumes there."""
        padding = self.meter.epoch_padding_fraction(self.accelerator)  # --group_by_length lowers it
        logger.info(f"epoch {self.epoch + 1}: {padding:.1%} of the batches' tokens were padding")
        self._record({"epoch_padding_fraction": padding})
        total, counted = self.accelerator.reduce(self.epoch_loss.clone(), reduction="sum").tolist()
        if (
            counted
        ):  # the epoch's mean loss over every process's batches (an epoch resumed at its end has none)
            self.train_loss = total / counted
        self.epoch_loss.zero_()
        self.epoch, self.batches_in_epoch = self.epoch + 1, 0

    # ------------------------------------------------------------------ the end
    def _write_all_results(self, summary: dict) -> None:
        """all_results.json, as the transformers example the recipe stands in for writes it (its
        keys; the numbers of eval_results.json), on the main process."""
        if self.accelerator.is_main_process and getattr(self.args, "example", None):
            no_trainer.write_all_results(self.args.output_dir, no_trainer.all_results(summary, self.args))

    def _predictions(self) -> dict:
        """--do_predict: the recipe's predict function writes the prediction files into
        --output_dir; their counts (`predict_*`) go into eval_results.json."""
        if not getattr(self.args, "do_predict", False):
            return {}
        counts = self.predict()
        logger.info(f"Predictions written to {self.args.output_dir}: {counts}")
        return counts

    def _load_best_model(self) -> dict:
        """--load_best_model_at_end: the best evaluation's weights back into the model, from its
        checkpoint through accelerate's load_state as a resume does (FSDP and ZeRO shards too); its
        scores, for eval_results.json. Nothing to do when the last evaluation was the best."""
        best = self.best
        if best.step is None or best.step == self.step:  # no finite score, or the model is the best
            return {}
        path = self._best_checkpoint()
        if path is None:  # --load_best_model_at_end given only when resuming, and no better evaluation since
            logger.warning(
                f"No checkpoint holds the best evaluation (step {best.step}): the final model is the last step's."
            )
            return {}
        checkpoint.read_checkpoint(path, self.identity)  # complete, intact, of this run
        checkpoint.load_checkpoint(self.accelerator, path)
        logger.info(f"Loaded the best model (step {best.step}, {best.key} {best.value}) from {path}")
        return best.results

    def save_final_model(self, tokenizer) -> dict:
        """The trained model and tokenizer, then eval_results.json with the run's summary."""
        accelerator, model = self.accelerator, self.model
        self.progress.close()
        self.preemption.restore()  # from here a signal stops the process, as it did before training
        self.activations.remove()  # its hooks are not part of the saved model
        self.stop_if_loss_diverged()  # AMP: never saves inf/NaN
        summary = {
            **self.results,
            **self.facts,
            "model_name_or_path": self.args.model_name_or_path,
            "train_steps": self.step,
            "train_loss": self.train_loss,  # the last epoch's mean training loss
            **self.meter.run_rates(),  # training runtime, samples/s and tokens/s (evaluation left out)
            "peak_memory_bytes": peak_memory_bytes(accelerator.device),
            **self.telemetry.summary(),  # AMP: fp16 skipped steps and final loss scale; non-finite losses
            "fp16_range": self.activations.read(),  # AMP: max |activation| / 65504 of the modules closest to it
            **self.compiled.report(),  # --torch_compile: compiled_graphs, recompile_limit_hit
            # The best evaluation's step; whether the patience ran out before the last scheduled step.
            **(
                self.best.summary(self.early_stopped and self.step < self.schedule.max_train_steps)
                if self.best
                else {}
            ),
        }
        if self.args.load_best_model_at_end:  # the best evaluation's weights and scores
            summary.update(self._load_best_model())
        # AMP: the fp32 master weights, gathered under FSDP / ZeRO, under the plain model's names
        state_dict = outputs.plain_state_dict(accelerator, model)
        transformers_model = isinstance(self.plain_model, PreTrainedModel)
        with self.output.final_model(accelerator) as folder:  # .final.tmp, renamed into place when complete
            if transformers_model:  # config.json and the weights, for from_pretrained
                self.plain_model.save_pretrained(
                    folder,
                    is_main_process=accelerator.is_main_process,
                    save_function=accelerator.save,
                    state_dict=dict(state_dict),  # a copy: save_pretrained empties the dict it is given
                )
            elif accelerator.is_main_process:  # a model of your own: model.safetensors, for load_model
                outputs.save_weights(folder, state_dict, self.plain_model)
            if accelerator.is_main_process:
                if transformers_model:
                    outputs.write_saved_dtype(folder, state_dict)  # config.json says fp32, as the weights are
                tokenizer.save_pretrained(folder)
                # README.md: task, data, precision, settings, command, dev scores (model-index metadata)
                card = hub.model_card(self.plain_model, self.args, summary, self.identity, self.hub_repo)
                card.save(folder / "README.md")
        summary.update(self._predictions())  # --do_predict: the final model's, on the test examples
        if self.peers is not None:  # the run's last collective is behind it: what is left is this rank's own
            self.peers.stop()
        self._write_all_results(summary)  # the transformers example's all_results.json, same numbers
        self.record.write_results(summary)  # written last: its presence means the run finished
        outputs.write_final_figures(accelerator, summary, self.step)  # W&B run summary, TensorBoard
        logger.info(
            f"Saved model and eval_results.json to {self.args.output_dir}: {describe_results(summary)}"
        )
        self.ended = True  # the run finished; an upload that fails says so and leaves it finished
        if self.hub_repo:
            logger.info(
                f"Uploaded to {hub.push_to_hub(self.hub_repo, Path(self.args.output_dir), self.args)}"
            )
        return summary


def describe_model(model) -> tuple[str, str, str | None]:
    """(model type, shape, attention implementation) for the run facts and a checkpoint's
    identity: a transformers model's from its config (`bert/12x768`); a model of your own (an
    nn.Module) its class and its number of parameter tensors, which sharding does not change."""
    if isinstance(model, PreTrainedModel):
        config = model.config
        shape = f"{config.model_type}/{config.num_hidden_layers}x{config.hidden_size}"
        return config.model_type, shape, config._attn_implementation
    name = type(model).__name__
    return name, f"{name}/{len(list(model.parameters()))} parameter tensors", None


def run_end(exc: BaseException | None) -> str:
    """How a run ends, for errors.mark_end: finished, stopped (a preemption's 143/130), lost
    (another rank's loss failed a collective) or error."""
    if exc is None or (isinstance(exc, SystemExit) and not exc.code):
        return "finished"
    if isinstance(exc, SystemExit) and exc.code in (130, 143):
        return "stopped"
    return "lost" if lost_rank_message(exc) else "error"


ENGINES = {"NO": "one device", "MULTI_GPU": "DDP", "MULTI_CPU": "DDP over gloo", "DEEPSPEED": "DeepSpeed"}


def describe_run(args, precision: dict, facts: dict, schedule, resumed_at: int) -> str:
    """The run in a few lines, for the console: what trains on what, in which precision, with which
    batch, for how many steps, into which folder. Every setting is in run_config.json and the
    trackers' config (a line of the whole would run to thousands of characters)."""
    task = facts.get("task_name") or facts.get("objective") or "your data"
    processes, accumulation = facts["num_processes"], args.gradient_accumulation_steps
    epochs = f"{schedule.num_epochs} epoch{'s' * (schedule.num_epochs != 1)}"
    start = f", from step {resumed_at}" if resumed_at else ""
    # The scheduler counts a step once per process (outside DeepSpeed): in optimizer steps here.
    warmup = schedule.warmup_steps // max(schedule.scheduler_steps // schedule.max_train_steps, 1)
    lines = [
        f"Run: {task}, {args.model_name_or_path}, {precision['precision_in_effect']} "
        f"({ENGINES.get(facts['distributed_type'], facts['distributed_type'])}, "
        f"{processes} process{'es' * (processes != 1)})"
    ]
    if args.eval_only:
        lines.append("  evaluation only (--eval_only)")
    else:
        lines += [
            f"  batch:  {args.per_device_train_batch_size} per process x {processes} x {accumulation} "
            f"accumulated = {facts['total_train_batch_size']} examples per optimizer step",
            f"  steps:  {schedule.max_train_steps} optimizer steps ({schedule.steps_per_epoch} per epoch, "
            f"{epochs}){start}, learning rate {args.learning_rate:g} after {warmup} warm-up steps",
        ]
    lines.append(f"  output: {args.output_dir} (every setting in run_config.json)")
    return "\n".join(lines)


def describe_results(summary: dict) -> str:
    """The end of a run in one line: its scores, steps, time, throughput and memory (every figure
    is in eval_results.json)."""
    scores = ", ".join(
        f"{name} {value:.4g}"
        for name, value in summary.items()
        if name.startswith("eval_") and not name.endswith(hub.NOT_SCORES) and isinstance(value, (int, float))
    )
    parts = [scores or "no evaluation", f"{summary['train_steps']} steps"]
    if summary.get("train_runtime_seconds") is not None:
        parts.append(f"{summary['train_runtime_seconds']:.3g} s of training")
    if summary.get("train_samples_per_second"):
        parts.append(f"{summary['train_samples_per_second']:.1f} samples/s")
    if summary.get("peak_memory_bytes"):
        parts.append(f"peak memory {summary['peak_memory_bytes'] / 2**30:.2f} GiB")
    if "skipped_steps" in summary:
        parts.append(f"{summary['skipped_steps']} fp16 steps skipped, loss scale {summary['loss_scale']:g}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- the best evaluation
# The best evaluation of a run: --metric_for_best_model, --load_best_model_at_end and
# --early_stopping_patience, as the Trainer has them.
#
# accelerate has no notion of a best checkpoint, and the Trainer's (`TrainerState.best_metric`,
# `EarlyStoppingCallback`) lives inside the Trainer's loop, so the recipes keep their own: which
# evaluation was best, at which step, in which checkpoint, and how many evaluations since then
# brought no improvement. Its state goes into every checkpoint's record, so a resumed run goes on
# comparing against the same best and counting the same patience.
LOWER_IS_BETTER = ("loss", "perplexity")  # the Trainer's rule ("loss") and the masked LM's perplexity


def metric_key(name: str) -> str:
    """The eval_results.json key of --metric_for_best_model: `f1` and `eval_f1` both name `eval_f1`."""
    return name if name.startswith("eval_") else f"eval_{name}"


class BestModel:
    """Which evaluation so far was best by --metric_for_best_model, and whether to stop early."""

    def __init__(self, args, state: dict | None = None):
        self.key = metric_key(args.metric_for_best_model)
        if args.greater_is_better is None:
            self.greater_is_better = not any(word in self.key for word in LOWER_IS_BETTER)
        else:
            self.greater_is_better = args.greater_is_better == "true"
        self.patience = args.early_stopping_patience
        state = state or {}
        # A checkpoint's best ranked by another metric or direction is not this run's best.
        self.restarted = bool(state) and (state.get("key"), state.get("greater_is_better")) != (
            self.key,
            self.greater_is_better,
        )
        state = {} if self.restarted else state
        self.value, self.step = state.get("value"), state.get("step")
        self.results = state.get("results")  # the best evaluation's scores, as eval_results.json has them
        self.checkpoint = state.get("checkpoint")  # its checkpoint's folder name (--load_best_model_at_end)
        self.evaluations_without_improvement = state.get("evaluations_without_improvement", 0)

    def update(self, results: dict, step: int) -> bool:
        """Take an evaluation's scores; True when it is the best so far. A score that is not finite
        never is."""
        if self.key not in results:
            names = ", ".join(k for k in results if k.startswith("eval_"))
            raise InputError(
                f"--metric_for_best_model {self.key} is not a score of this evaluation; it has {names}."
            )
        value = results[self.key]
        if math.isfinite(value) and (self.value is None or self.beats(value)):
            self.value, self.step, self.results = value, step, dict(results)
            self.evaluations_without_improvement = 0
            return True
        self.evaluations_without_improvement += 1
        return False

    def beats(self, value: float) -> bool:
        """Whether `value` is better than the best so far (a tie is not)."""
        return value > self.value if self.greater_is_better else value < self.value

    @property
    def stop(self) -> bool:
        """--early_stopping_patience evaluations in a row without improvement."""
        return bool(self.patience) and self.evaluations_without_improvement >= self.patience

    def state_dict(self) -> dict:
        return {
            "key": self.key,
            "greater_is_better": self.greater_is_better,
            "value": self.value,
            "step": self.step,
            "results": self.results,
            "checkpoint": self.checkpoint,
            "evaluations_without_improvement": self.evaluations_without_improvement,
        }

    def summary(self, stopped_early: bool) -> dict:
        """For eval_results.json and the trackers: the metric, its best value and step, its
        checkpoint, and whether the patience ran out before the last scheduled step."""
        return {
            "metric_for_best_model": self.key,
            "best_metric": self.value,
            "best_step": self.step,
            "best_model_checkpoint": self.checkpoint,
            "stopped_early": stopped_early,
        }
