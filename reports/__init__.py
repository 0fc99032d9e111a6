"""oscar.reports: report builders (Markdown/HTML, plots, parquet). Reads result files only."""
