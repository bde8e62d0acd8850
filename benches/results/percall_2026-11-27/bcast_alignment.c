#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){MPI_Init(&argc,&argv);int r,n;MPI_Comm_rank(MPI_COMM_WORLD,&r);MPI_Comm_size(MPI_COMM_WORLD,&n);
 int reps=2000; int offs[][2]={{0,0},{16,16},{1168,432},{16,1104},{2224,1536},{64,64},{0,2048}};
 int no=sizeof(offs)/sizeof(offs[0]); size_t bytes=65536;
 char *base; posix_memalign((void**)&base,4096,bytes+8192); for(size_t i=0;i<bytes+8192;i++) base[i]=i;
 double *t=malloc(sizeof(double)*reps*no);
 for(int it=0;it<reps;it++) for(int k=0;k<no;k++){ int kk=(k+it)%no; char*buf=base+offs[kk][r==0?0:1];
   MPI_Barrier(MPI_COMM_WORLD); double t0=MPI_Wtime(); MPI_Bcast(buf,bytes/4,MPI_FLOAT,0,MPI_COMM_WORLD); t[kk*reps+it]=MPI_Wtime()-t0; }
 double *mx=malloc(sizeof(double)*reps);
 for(int k=0;k<no;k++){ MPI_Reduce(t+k*reps,mx,reps,MPI_DOUBLE,MPI_MAX,0,MPI_COMM_WORLD); if(r==0){qsort(mx,reps,sizeof(double),cmp); printf("root off %4d, other off %4d: bcast 64K median %.1f us\n",offs[k][0],offs[k][1],mx[reps/2]*1e6);} }
 MPI_Finalize();}
