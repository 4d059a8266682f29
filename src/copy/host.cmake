# Host copy engine sources (engine module).
