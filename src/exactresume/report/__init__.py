"""The lab's report: markdown (report), tables (tables), figures and their captions, drawn only from
the json and csv files a run wrote. Imports store, core and the base layer.
"""
