"""Rule report: summary table, markdown summary and figures."""

from draftflow.report.build import ReportPaths, build_report
from draftflow.report.summary import Bootstrap
from draftflow.workflow.script import setup_logging, target_dir

log = setup_logging(snakemake)
out = snakemake.output
summary = build_report(
    bench_csvs=snakemake.input.bench,
    unit_csvs=snakemake.input.units,
    bootstrap=Bootstrap(**snakemake.params.bootstrap),
    schedule=snakemake.params.schedule,
    train_metrics=snakemake.input.train_metrics,
    target_dir=target_dir(snakemake),
    draft_dir=snakemake.input.draft,
    extract_dirs=snakemake.input.extract,
    out=ReportPaths(
        summary=out.summary,
        markdown=out.markdown,
        acceptance_length=out.acceptance_length,
        acceptance_per_pos=out.acceptance_per_pos,
        speedup=out.speedup,
        train_loss=out.train_loss,
        train_accuracy=out.train_accuracy,
    ),
)
log.info("summary:\n%s", summary)
