"""Stage 6, the report: report.json and scores.npy (`build`), its typed schema (`schema`), the self-contained page
(`html`, `plots`) and the terminal tables (`terminal`)."""
