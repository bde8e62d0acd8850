/* Counts a rank's MPI calls (PMPI interposition); rank 1 prints them at MPI_Finalize.
 * mpicc -shared -fPIC -O2 -o libcount.so pmpi_count.c
 * mpirun -np 4 -x LD_PRELOAD=$PWD/libcount.so target/release/examples/bench_dist_store --sizes 4K --no-small --store-only --reps 1000 */
#define _GNU_SOURCE
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
static long n_ibcast, n_bcast, n_iallgather, n_allgather, n_ireduce, n_reduce, n_test, n_testall, n_wait, n_waitall, n_ibarrier, n_barrier, n_iallreduce, n_allreduce, n_isend, n_irecv, n_iprobe, n_igather, n_gather;
#define C(name, counter, proto, args) int name proto { counter++; return P##name args; }
C(MPI_Ibcast, n_ibcast, (void*b,int c,MPI_Datatype d,int r,MPI_Comm m,MPI_Request*q), (b,c,d,r,m,q))
C(MPI_Bcast, n_bcast, (void*b,int c,MPI_Datatype d,int r,MPI_Comm m), (b,c,d,r,m))
C(MPI_Iallgather, n_iallgather, (const void*s,int sc,MPI_Datatype st,void*r,int rc,MPI_Datatype rt,MPI_Comm m,MPI_Request*q), (s,sc,st,r,rc,rt,m,q))
C(MPI_Allgather, n_allgather, (const void*s,int sc,MPI_Datatype st,void*r,int rc,MPI_Datatype rt,MPI_Comm m), (s,sc,st,r,rc,rt,m))
C(MPI_Ireduce, n_ireduce, (const void*s,void*r,int c,MPI_Datatype d,MPI_Op o,int root,MPI_Comm m,MPI_Request*q), (s,r,c,d,o,root,m,q))
C(MPI_Reduce, n_reduce, (const void*s,void*r,int c,MPI_Datatype d,MPI_Op o,int root,MPI_Comm m), (s,r,c,d,o,root,m))
C(MPI_Iallreduce, n_iallreduce, (const void*s,void*r,int c,MPI_Datatype d,MPI_Op o,MPI_Comm m,MPI_Request*q), (s,r,c,d,o,m,q))
C(MPI_Allreduce, n_allreduce, (const void*s,void*r,int c,MPI_Datatype d,MPI_Op o,MPI_Comm m), (s,r,c,d,o,m))
C(MPI_Test, n_test, (MPI_Request*q,int*f,MPI_Status*s), (q,f,s))
C(MPI_Testall, n_testall, (int c,MPI_Request*q,int*f,MPI_Status*s), (c,q,f,s))
C(MPI_Wait, n_wait, (MPI_Request*q,MPI_Status*s), (q,s))
C(MPI_Waitall, n_waitall, (int c,MPI_Request*q,MPI_Status*s), (c,q,s))
C(MPI_Ibarrier, n_ibarrier, (MPI_Comm m,MPI_Request*q), (m,q))
C(MPI_Barrier, n_barrier, (MPI_Comm m), (m))
C(MPI_Isend, n_isend, (const void*b,int c,MPI_Datatype d,int t,int g,MPI_Comm m,MPI_Request*q), (b,c,d,t,g,m,q))
C(MPI_Irecv, n_irecv, (void*b,int c,MPI_Datatype d,int s,int g,MPI_Comm m,MPI_Request*q), (b,c,d,s,g,m,q))
C(MPI_Iprobe, n_iprobe, (int s,int g,MPI_Comm m,int*f,MPI_Status*st), (s,g,m,f,st))
C(MPI_Igather, n_igather, (const void*s,int sc,MPI_Datatype st,void*r,int rc,MPI_Datatype rt,int root,MPI_Comm m,MPI_Request*q), (s,sc,st,r,rc,rt,root,m,q))
C(MPI_Gather, n_gather, (const void*s,int sc,MPI_Datatype st,void*r,int rc,MPI_Datatype rt,int root,MPI_Comm m), (s,sc,st,r,rc,rt,root,m))
int MPI_Finalize(void){ int r; MPI_Comm_rank(MPI_COMM_WORLD,&r); if(r==1) fprintf(stderr,"rank1 ibcast %ld bcast %ld iallgather %ld allgather %ld ireduce %ld reduce %ld iallreduce %ld allreduce %ld igather %ld gather %ld ibarrier %ld barrier %ld isend %ld irecv %ld iprobe %ld test %ld testall %ld wait %ld waitall %ld\n", n_ibcast,n_bcast,n_iallgather,n_allgather,n_ireduce,n_reduce,n_iallreduce,n_allreduce,n_igather,n_gather,n_ibarrier,n_barrier,n_isend,n_irecv,n_iprobe,n_test,n_testall,n_wait,n_waitall); return PMPI_Finalize(); }
