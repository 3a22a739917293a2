/*
 * option_external.h — the environment variables flotilla reads that are not
 * its options: set by launchers (mpirun, PMIx, srun) and CUDA. No include
 * guard: expanded with FL_OPT_EXTERNAL defined (core/option.c).
 * Read them with fl_opt_external(name); `flotilla env` lists them.
 *
 * FL_OPT_EXTERNAL("NAME", "one-line doc")
 */
FL_OPT_EXTERNAL("OMPI_COMM_WORLD_SIZE", "Open MPI (mpirun): ranks of the job; set means an MPI launch")
FL_OPT_EXTERNAL("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI (mpirun): this rank's index on its node")
FL_OPT_EXTERNAL("PMIX_RANK", "PMIx launchers: this process's rank; set means an MPI launch")
FL_OPT_EXTERNAL("PMIX_NAMESPACE", "PMIx launchers: the job's namespace")
FL_OPT_EXTERNAL("PMI_RANK", "PMI launchers (MPICH, Intel MPI): this process's rank")
FL_OPT_EXTERNAL("PMI_SIZE", "PMI launchers: ranks of the job")
FL_OPT_EXTERNAL("MPI_LOCALRANKID", "MPICH / Intel MPI: this rank's index on its node")
FL_OPT_EXTERNAL("SLURM_STEP_ID", "Slurm: set in an srun step's tasks (a batch script is one process)")
FL_OPT_EXTERNAL("SLURM_PROCID", "Slurm: this task's rank in the step")
FL_OPT_EXTERNAL("SLURM_STEP_NUM_TASKS", "Slurm: tasks of the step")
FL_OPT_EXTERNAL("SLURM_NTASKS", "Slurm: tasks of the job (when SLURM_STEP_NUM_TASKS is unset)")
FL_OPT_EXTERNAL("SLURM_LOCALID", "Slurm: this task's index on its node")
FL_OPT_EXTERNAL("OMP_NUM_THREADS", "CPU threads when --threads is not given (default: the CPUs the rank may run on)")
FL_OPT_EXTERNAL("CUDA_VISIBLE_DEVICES", "CUDA: the GPUs this process sees (rank discovery maps local ranks onto them)")
