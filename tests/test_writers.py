"""Every call in meshloom/ that writes, replaces, links or deletes a file either goes through the output rule
(meshloom/output.py) or writes only what its run made, into a folder the run owns. The second kind are listed in
WRITERS, call by call, each with its reason; a new writer fails this test until it is one or the other, even
beside a listed call in the same function.

The walk (writer_walk.py) covers every way to write that meshloom or its libraries offer: open() and Path
methods, torch/numpy/safetensors savers, DCP, os and shutil, new folders, links, temporary files, logging file handlers,
the profiler's trace and memory-timeline exports, CUDA memory snapshots, TensorBoard, wandb, Ray's storage and
transformers' save_pretrained. Names are resolved through imports, relative ones included. A call inside a
`with staged_file(...) as tmp:` block passes only when it writes into `tmp`."""

from __future__ import annotations

from pathlib import Path

from writer_walk import find_writers

PACKAGE = Path(__file__).resolve().parents[1] / "meshloom"
RULE = "meshloom/output.py"

# meshloom's own writing functions, which write where their caller says: a call to one is a writer too, so a command
# that hands one a user's path (not a staged temporary) fails here like a bare write.
WRITING_FUNCTIONS = {
    "meshloom.checkpoint.hf.write_hf_folder", "meshloom.checkpoint.offline.save_weights",
    "meshloom.checkpoint.offline.write_side_files", "meshloom.data.tokenizer.atomic_write_bytes",
    "meshloom.data.shard_format.write_json", "meshloom.checkpoint.folders.write_json_atomic",
    "meshloom.checkpoint.folders.remove", "meshloom.testing.layout_parity.plot",
}  # fmt: skip

# "module:function call(...)" -> why that call may write without the output rule: it writes only what its run made,
# into a folder the run owns. One entry per call, so a second writer in a listed function is not covered.
WRITERS: dict[str, str] = {
    'meshloom/checkpoint/dcp.py:Checkpointer._save folders.remove(path)': "a crashed save's step folder, removed only when owned_by this lineage (checked just above)",
    'meshloom/checkpoint/dcp.py:Checkpointer._save write_side_files(path, self.config, self.plan.spec, self.plan.model_args)': "the run's own step-N folder, claimed with save.json before anything is written; a foreign one is refused at start-up",
    'meshloom/checkpoint/dcp.py:Checkpointer._save dcp.async_save(state, storage_writer=FileSystemWriter(path), process_group=group, async_stager=self._host_stager(), no_dist=not distributed())': "the run's own step-N folder, claimed with save.json before anything is written; a foreign one is refused at start-up",
    'meshloom/checkpoint/dcp.py:Checkpointer._save dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=not distributed())': "the run's own step-N folder, claimed with save.json before anything is written; a foreign one is refused at start-up",
    "meshloom/checkpoint/folders.py:write_json_atomic open(tmp, 'w')": 'a temporary beside a marker (save.json, complete.json) in a step folder the run claimed',
    'meshloom/checkpoint/folders.py:write_json_atomic os.replace(tmp, path)': 'renames that temporary onto the marker: all or nothing',
    'meshloom/checkpoint/folders.py:commit write_json_atomic(Path(path) / MARKER_FILE, marker)': 'complete.json in a step folder this run claimed',
    "meshloom/checkpoint/folders.py:claim write_json_atomic(path / OWNER_FILE, {'lineage': lineage, 'step': step})": "save.json that marks a new step folder as this run's",
    'meshloom/checkpoint/folders.py:remove (Path(path) / MARKER_FILE).unlink(missing_ok=True)': "the marker of a step folder of this run's lineage (its callers check owned_by), first",
    'meshloom/checkpoint/folders.py:remove shutil.rmtree(path, ignore_errors=True)': 'then the rest of that step folder',
    'meshloom/checkpoint/folders.py:prune remove(path)': "this lineage's own older step folders (owned_by), never another's",
    'meshloom/checkpoint/hf.py:write_hf_folder save_file(shards[0], out / WEIGHTS_FILE, metadata=metadata)': "fills the folder its caller gives: a staged_folder temporary, or the run's hf/.step-N.tmp-<pid>",
    'meshloom/checkpoint/hf.py:write_hf_folder save_file(shard, out / file, metadata=metadata)': "fills the folder its caller gives: a staged_folder temporary, or the run's hf/.step-N.tmp-<pid>",
    'meshloom/checkpoint/hf.py:write_hf_folder (out / INDEX_FILE).write_text(json.dumps(index, indent=2))': "fills the folder its caller gives: a staged_folder temporary, or the run's hf/.step-N.tmp-<pid>",
    'meshloom/checkpoint/hf.py:write_hf_folder (out / CONFIG_FILE).write_text(json.dumps(adapter.config_from_args(args, dtype, base_config), indent=2))': "fills the folder its caller gives: a staged_folder temporary, or the run's hf/.step-N.tmp-<pid>",
    'meshloom/checkpoint/hf_export.py:HFExporter._write shutil.rmtree(tmp, ignore_errors=True)': 'a leftover temporary of this process id, before it writes there',
    'meshloom/checkpoint/hf_export.py:HFExporter._write write_hf_folder(state, self.plan.spec, self.plan.model_args, tmp, self.dtype, base_config=self.base_config)': '<run>/hf/.step-N.tmp-<pid> of this process, then renamed to hf/step-N',
    'meshloom/checkpoint/hf_export.py:HFExporter._write (tmp / name).write_bytes(data)': '<run>/hf/.step-N.tmp-<pid> of this process, then renamed to hf/step-N',
    'meshloom/checkpoint/hf_export.py:HFExporter._write (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=1))': '<run>/hf/.step-N.tmp-<pid> of this process, then renamed to hf/step-N, with the lineage that made it',
    'meshloom/checkpoint/hf_export.py:HFExporter._write shutil.rmtree(final)': "an earlier export of the same step by this lineage only (export_lineage checked); another run's is left",
    'meshloom/checkpoint/hf_export.py:HFExporter._write os.replace(tmp, final)': 'moves the finished export into the step-N place just freed, or never used',
    'meshloom/checkpoint/offline.py:write_side_files (path / folders.CONFIG_FILE).write_text(json.dumps(to_dict(config), indent=1))': "side files of a step folder being saved (the run's claimed one, or a staged_folder temporary)",
    'meshloom/checkpoint/offline.py:write_side_files (path / folders.MODEL_ARGS_FILE).write_text(json.dumps(model_info, indent=1))': "side files of a step folder being saved (the run's claimed one, or a staged_folder temporary)",
    'meshloom/checkpoint/offline.py:save_weights write_side_files(path, config, spec, args, extra)': 'fills a new, empty folder (asserted): a staged_folder temporary',
    "meshloom/checkpoint/offline.py:save_weights dcp.save({'model': ModelState([model])}, storage_writer=FileSystemWriter(path), no_dist=True)": 'fills a new, empty folder (asserted): a staged_folder temporary',
    "meshloom/data/loader.py:tokenize_corpus open(tmp, 'wb')": 'the token cache in data.cache_dir, named from the corpus and tokenizer, written via a temporary',
    'meshloom/data/loader.py:tokenize_corpus np.save(f, tokens)': 'the token cache in data.cache_dir, named from the corpus and tokenizer, written via a temporary',
    'meshloom/data/loader.py:tokenize_corpus os.replace(tmp, path)': 'the token cache in data.cache_dir, named from the corpus and tokenizer, written via a temporary',
    'meshloom/data/loader.py:tokenize_corpus tmp.unlink(missing_ok=True)': 'the temporary of a cache write that failed',
    'meshloom/data/prepare.py:_ShardWriter.flush atomic_write_bytes(index_path(self.folder, name), index_bytes)': "a new shard's index in the prepare folder check_resumable_folder accepted",
    'meshloom/data/prepare.py:_ShardWriter.flush atomic_write_bytes(tokens_path(self.folder, name), token_bytes)': "a new shard's tokens in the prepare folder check_resumable_folder accepted",
    'meshloom/data/prepare.py:prepare shutil.rmtree(folder, ignore_errors=True)': 'only the --output folder this prepare made, when it finished no shard',
    'meshloom/data/prepare.py:prepare parent.rmdir()': 'only parent folders this prepare made (empty: rmdir)',
    'meshloom/data/prepare.py:_prepare_into (folder / META_FILE).unlink(missing_ok=True)': 'meta.json of the accepted prepare folder, stale until this prepare completes',
    "meshloom/data/prepare.py:_prepare_into.close_shard write_json(folder / STATE_FILE, {'settings': settings, 'shards': entries, 'complete': False})": 'prepare_state.json of the accepted prepare folder',
    'meshloom/data/prepare.py:_prepare_into write_json(folder / META_FILE, meta)': 'meta.json of the accepted prepare folder',
    "meshloom/data/prepare.py:_prepare_into write_json(folder / STATE_FILE, {'settings': settings, 'shards': entries, 'complete': True})": 'prepare_state.json of the accepted prepare folder',
    "meshloom/data/shard_format.py:write_json atomic_write_bytes(Path(path), (json.dumps(value, indent=1, sort_keys=True) + '\\n').encode())": "prepare's state and meta files (its callers are listed)",
    'meshloom/data/tokenizer.py:atomic_write_bytes tmp.write_bytes(data)': 'the function itself: a temporary beside the target, then a rename (each caller is listed)',
    'meshloom/data/tokenizer.py:atomic_write_bytes os.replace(tmp, path)': 'the function itself: a temporary beside the target, then a rename (each caller is listed)',
    'meshloom/data/tokenizer.py:atomic_write_bytes tmp.unlink(missing_ok=True)': 'the function itself: a temporary beside the target, then a rename (each caller is listed)',
    "meshloom/data/tokenizer.py:_builtin atomic_write_bytes(cached, tok.to_str().encode('utf-8'))": "the trained tokenizer's cache file in data.cache_dir, named from its settings",
    "meshloom/launch/ray_train.py:run_on_ray RunConfig(name=name, storage_path=str(run_dir / 'ray'), failure_config=FailureConfig(max_failures=max_failures), checkpoint_config=CheckpointConfig(num_to_keep=1))": "Ray's own records in <run>/ray of the run it launches",
    "meshloom/launch/ray_train.py:_attempt_of_this_run attempts.write_text(json.dumps({'launch': launch, 'attempt': box[0]}))": "the attempt count in the launch's own <run>/ray folder",
    'meshloom/observe/flight_recorder.py:dump tmp.write_text(json.dumps(record, indent=1, default=str))': '<run>/flight_recorder/attempt-N/rank-R.json of this run, via a temporary',
    'meshloom/observe/flight_recorder.py:dump os.replace(tmp, path)': '<run>/flight_recorder/attempt-N/rank-R.json of this run, via a temporary',
    "meshloom/observe/logging.py:MetricLogger.__init__ open(self.run_dir / 'metrics.jsonl', 'a', encoding='utf-8')": "appends to the run's metrics.jsonl (check_run_folder: this run's, or the one it resumes)",
    "meshloom/observe/logging.py:MetricLogger.__init__ SummaryWriter(log_dir=str(self.run_dir / 'tb'))": 'new event files in <run>/tb of the checked run folder (TensorBoard never replaces one)',
    "meshloom/observe/logging.py:MetricLogger.__init__ wandb_module.init(project=wandb_project, name=self.run_dir.name, dir=str(self.run_dir), config=wandb_config, resume='allow')": "wandb's local files under <run>/wandb of the checked run folder",
    'meshloom/observe/cpu_peak.py:keep_cpu_peak tmp.write_text(json.dumps(kept, indent=1, sort_keys=True))': "meshloom's own CPU peak file in ~/.cache/meshloom, via a temporary",
    'meshloom/observe/cpu_peak.py:keep_cpu_peak os.replace(tmp, path)': "meshloom's own CPU peak file in ~/.cache/meshloom, via a temporary",
    "meshloom/observe/profiler.py:StepProfiler._write_trace prof.export_chrome_trace(str(self.trace_dir / f'rank{self.rank}.pt.trace.json'))": "<run>/profile/steps_A-B/ of this run (check_run_folder: this run's folder, or the one it resumes)",
    "meshloom/observe/profiler.py:StepProfiler._write_trace prof.export_memory_timeline(str(self.trace_dir / f'memory_timeline_rank{self.rank}.{suffix}'), device='cpu')": "<run>/profile/steps_A-B/ of this run (check_run_folder: this run's folder, or the one it resumes)",
    "meshloom/observe/profiler.py:StepProfiler._dump_cuda_snapshot torch.cuda.memory._dump_snapshot(str(self.snapshot_dir / f'rank{self.rank}_{tag}.pickle'))": '<run>/memory_snapshot/ of this run (the checked run folder)',
    'meshloom/testing/layout_parity.py:launch cases_file.write_text(json.dumps(cases))': "the parity harness's cases file in its own work folder",
    'meshloom/testing/layout_parity.py:worker out_file.write_text(json.dumps(curves))': "a worker's result file in the harness's own work folder",
    "meshloom/testing/layout_parity.py:compare tempfile.mkdtemp(prefix='meshloom-parity-')": "the harness's own new work folder in the system's temporary folder",
    "meshloom/testing/layout_parity.py:plot figure.savefig(out, dpi=110, format='png')": 'writes where `meshloom parity` says: a staged_file temporary',
    "meshloom/testing/matrix_run.py:_sharing_the_cache (home / 'cache').symlink_to(workdir / 'cache')": "a link to the data cache inside the matrix's own work folder",
    "meshloom/testing/ranks.py:_rank_main os.open(os.path.join(log_dir, f'rank{local_rank}.log'), os.O_WRONLY | os.O_CREAT | os.O_APPEND)": "a forked test rank's log in the launcher's own log folder",
    "meshloom/testing/ranks.py:run_ranks tempfile.TemporaryDirectory(prefix='meshloom-ranks-')": "the launcher's own log folder, removed when the launch ends",
    "meshloom/testing/replica_launch.py:start_training log.open('w')": "a log file in the harness's own work folder",
    "meshloom/testing/replica_launch.py:Lighthouse.__init__ (workdir / 'lighthouse.log').open('w')": "the Lighthouse log in the harness's own work folder",
    "meshloom/testing/resume_parity.py:_killed_now (run_dir / KILLED_RESULT).write_text(json.dumps({'losses': losses, 'sample_ids': [], 'grad_norms': grad_norms}))": "a killed rank's result file in the harness's own run folder",
    'meshloom/testing/resume_parity.py:launch_killed cases_file.write_text(json.dumps([asdict(case)]))': "the resume harness's cases file in its own work folder",
    'meshloom/testing/semi_sync_reference.py:launch cases_file.write_text(json.dumps([asdict(c) for c in cases]))': "the emulation's cases file in its own work folder",
    'meshloom/testing/semi_sync_reference.py:worker out_file.write_text(json.dumps(results))': "the emulation's result file in its own work folder",
    'meshloom/testing/resume_parity.py:launch cases_file.write_text(json.dumps([asdict(c) for c in group]))': "the resume harness's cases file in its own work folder",
    'meshloom/testing/resume_parity.py:worker out_file.write_text(json.dumps(results))': "a worker's result file in the harness's own work folder",
    'meshloom/train/nonfinite.py:write_dump path.write_text(json.dumps(dump, indent=1))': "<run>/diagnostics/nonfinite_stepN.json: a dump of the failing step in the run's own folder",
    "meshloom/train/run_folder.py:write_run_config open(path, 'x', encoding='utf-8')": "the run's config record, created exclusively ('x'): never over an existing file",
    'meshloom/checkpoint/folders.py:claim path.mkdir(parents=True, exist_ok=True)': 'the step folder this run claims, before its save.json',
    'meshloom/checkpoint/hf.py:write_hf_folder out.mkdir(parents=True, exist_ok=True)': "the folder its caller gives: a staged_folder temporary, or the run's hf/.step-N.tmp-<pid>",
    'meshloom/checkpoint/offline.py:write_side_files path.mkdir(parents=True, exist_ok=True)': "a step folder being saved (the run's claimed one, or a staged_folder temporary)",
    'meshloom/data/loader.py:tokenize_corpus path.parent.mkdir(parents=True, exist_ok=True)': "data.cache_dir, meshloom's own cache folder",
    'meshloom/data/prepare.py:prepare folder.mkdir(parents=True, exist_ok=True)': 'the --output folder check_resumable_folder accepted (removed again if it finishes no shard)',
    'meshloom/data/tokenizer.py:_builtin cache_dir.mkdir(parents=True, exist_ok=True)': "data.cache_dir, meshloom's own cache folder",
    'meshloom/launch/ray_train.py:_attempt_of_this_run attempts.parent.mkdir(parents=True, exist_ok=True)': "the launch's own <run>/ray folder",
    'meshloom/observe/flight_recorder.py:dump recorder.folder.mkdir(parents=True, exist_ok=True)': '<run>/flight_recorder/attempt-N of this run',
    'meshloom/observe/logging.py:MetricLogger.__init__ self.run_dir.mkdir(parents=True, exist_ok=True)': 'the run folder check_run_folder accepted',
    'meshloom/observe/cpu_peak.py:keep_cpu_peak path.parent.mkdir(parents=True, exist_ok=True)': "meshloom's own cache folder",
    'meshloom/observe/profiler.py:StepProfiler._write_trace self.trace_dir.mkdir(parents=True, exist_ok=True)': '<run>/profile/steps_A-B of this run',
    'meshloom/observe/profiler.py:StepProfiler._dump_cuda_snapshot self.snapshot_dir.mkdir(parents=True, exist_ok=True)': '<run>/memory_snapshot of this run',
    'meshloom/testing/layout_parity.py:compare workdir.mkdir(parents=True, exist_ok=True)': "the harness's work folder (`meshloom parity` refuses a --workdir that holds anything)",
    'meshloom/testing/matrix_run.py:_sharing_the_cache home.mkdir(exist_ok=True)': "a folder inside the matrix's own work folder",
    'meshloom/train/nonfinite.py:write_dump path.parent.mkdir(parents=True, exist_ok=True)': '<run>/diagnostics of this run',
    'meshloom/train/run_folder.py:check_run_folder run_dir.mkdir(parents=True, exist_ok=True)': "job.dump_folder, the run's own folder (a file there is refused first)",
}  # fmt: skip


def test_every_writer_goes_through_the_output_rule_or_is_listed() -> None:
    writers = find_writers(PACKAGE, WRITING_FUNCTIONS, skip=RULE)
    unlisted = [w for w in writers if w.key not in WRITERS]
    assert not unlisted, "writers that bypass meshloom/output.py; route them through it, or list the call with the folder its run owns:\n" + "\n".join(
        f"  {w.where} (line {w.line}): {w.call}" for w in unlisted
    )
    stale = sorted(set(WRITERS) - {w.key for w in writers})
    assert not stale, f"listed writers that no longer write (remove them from WRITERS): {stale}"


SAMPLE = """import os, shutil, tempfile, torch, logging, logging.handlers, wandb
import numpy as np
from shutil import rmtree as rm
from safetensors.torch import save_file
from torch.utils.tensorboard import SummaryWriter
from ray.train import RunConfig
import dataclasses
from pathlib import Path
from .folders import remove as drop
from . import folders

def writes(p, fig, x, prof, model, f, g):
    open(p, 'w'); open(p, mode='ab'); Path(p).open('x'); p.write_text('a'); p.write_bytes(b'a'); fig.savefig(p)
    torch.save(x, p); save_file(x, p); np.save(p, x); shutil.copy(p, p); shutil.move(p, p); rm(p)
    os.replace(p, p); os.rename(p, p); os.remove(p); os.unlink(p); p.unlink(); p.replace(p)
    os.open(p, os.O_WRONLY | os.O_CREAT)
    prof.export_chrome_trace(p); prof.export_memory_timeline(p, device='cpu'); torch.cuda.memory._dump_snapshot(p)
    SummaryWriter(log_dir=p); wandb.init(dir=p); RunConfig(storage_path=p)
    os.symlink(p, p); os.link(p, p); p.touch(); p.symlink_to(p); p.hardlink_to(p); tempfile.mkstemp(dir=p)
    tempfile.mkdtemp(); shutil.copyfileobj(f, g); x.tofile(p); logging.FileHandler(p)
    logging.handlers.RotatingFileHandler(p); model.save_pretrained(p); np.memmap(p, mode='w+')
    drop(p); folders.remove(p); p.mkdir(); os.makedirs(p)
    with staged_file(p) as tmp:
        tmp.write_text('through the rule'); fig.savefig(tmp)
        p.write_text('beside the rule, inside the block')

def reads(p, s, x):
    open(p); open(p, 'rb'); Path(p).open(); s.replace('a', 'b'); dataclasses.replace(x, a=1); [].remove(1)
    os.open(p, os.O_RDONLY); np.memmap(p, mode='r'); RunConfig(name='run'); logging.getLogger(p)

def listed(p):
    p.write_text('listed')
    p.write_text('listed')
    p.write_bytes(b'a second writer beside a listed one')
"""


def test_the_walk_finds_each_kind_of_writer(tmp_path: Path) -> None:
    """The finder itself: each kind of call the rule covers is found, aliases and relative imports resolved; reads
    and look-alikes are not; a staged block lets through only writes into its temporary; each call is its own."""
    package = tmp_path / "meshloom"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "sample.py").write_text(SAMPLE)
    found = find_writers(package, {"meshloom.sub.folders.remove"})
    by_function = {f: [w.call for w in found if w.where == f"meshloom/sub/sample.py:{f}"] for f in ("writes", "reads", "listed")}
    assert len(found) == sum(len(calls) for calls in by_function.values())
    assert not by_function["reads"], by_function["reads"]
    calls = by_function["writes"]
    expected = (
        "open(p, 'w')", "open(p, mode='ab')", "Path(p).open('x')", "p.write_text('a')", "p.write_bytes(b'a')", "fig.savefig(p)",
        "torch.save(x, p)", "save_file(x, p)", "np.save(p, x)", "shutil.copy(p, p)", "shutil.move(p, p)", "rm(p)",
        "os.replace(p, p)", "os.rename(p, p)", "os.remove(p)", "os.unlink(p)", "p.unlink()", "p.replace(p)",
        "os.open(p, os.O_WRONLY | os.O_CREAT)",
        "prof.export_chrome_trace(p)", "prof.export_memory_timeline(p, device='cpu')", "torch.cuda.memory._dump_snapshot(p)",
        "SummaryWriter(log_dir=p)", "wandb.init(dir=p)", "RunConfig(storage_path=p)",
        "os.symlink(p, p)", "os.link(p, p)", "p.touch()", "p.symlink_to(p)", "p.hardlink_to(p)", "tempfile.mkstemp(dir=p)",
        "tempfile.mkdtemp()", "shutil.copyfileobj(f, g)", "x.tofile(p)", "logging.FileHandler(p)",
        "logging.handlers.RotatingFileHandler(p)", "model.save_pretrained(p)", "np.memmap(p, mode='w+')",
        "drop(p)", "folders.remove(p)", "p.mkdir()", "os.makedirs(p)", "p.write_text('beside the rule, inside the block')",
    )  # fmt: skip
    assert calls == list(expected), sorted(set(calls) ^ set(expected))
    # One entry per call: two identical calls are two entries, and the one after them is a third.
    assert [w.key for w in found if w.where.endswith(":listed")] == [
        "meshloom/sub/sample.py:listed p.write_text('listed')",
        "meshloom/sub/sample.py:listed p.write_text('listed') #2",
        "meshloom/sub/sample.py:listed p.write_bytes(b'a second writer beside a listed one')",
    ]


def test_every_writing_function_is_found_where_it_is_called() -> None:
    """Each function in WRITING_FUNCTIONS is a function of meshloom that exists and writes: the walk reports a call inside it
    (a write, or a call of another such function), so no name in the list is a typo that would hide its callers."""
    writers = find_writers(PACKAGE, WRITING_FUNCTIONS, skip=RULE)
    for function in sorted(WRITING_FUNCTIONS):
        module, _, name = function.rpartition(".")
        where = f"{module.replace('.', '/')}.py:{name}"
        assert any(w.where == where for w in writers), f"{function} is listed as a writing function but writes nothing"
