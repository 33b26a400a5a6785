"""The ingest stage: find the images (class folders or a labels CSV), list the source folder,
inspect and admit or quarantine each file, assign splits, write the index. Never imported by
another stage's wing.
"""
